"""What a strategy declares, shared by its two halves: its exchanges (message types), its
settings section (`common/settings.py`), where its halves live. Nothing here imports torch, so a
run config is checked in milliseconds."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from florist.common.settings import NoSettings, Settings


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One message type: its Flower name (`category` or `category.action`), the settings its
    request carries beside the run's (a `Settings` subclass without prefix), and the client
    function that answers it, `(node, request) -> reply records`, given as a function that
    returns it (`lambda: client().train`): the client halves import torch, and a spec is read
    by tools that should not."""

    message_type: str
    handler: Callable[[], Callable[..., Any]]
    request: type[Settings] = NoSettings


def _node_info() -> Callable[..., Any]:
    from florist.client.app import info

    return info


# Every run starts with it, whatever the algorithm: the node's data sizes, shape, seen/unseen.
INFO = Exchange("query.info", _node_info)


@dataclasses.dataclass(frozen=True)
class StrategySpec:
    """An algorithm as both halves and the rest of florist see it."""

    name: str  # what `strategy` and `--strategy` take
    summary: str  # one line for help texts
    server: Callable[[], type]  # returns the server half, a `florist.server.strategy.ServerStrategy`
    exchanges: tuple[Exchange, ...]
    settings: type[Settings] = NoSettings
    # returns its own report section's `function(results, folder) -> markdown lines`
    report: Callable[[], Callable[..., list[str]]] | None = None
    commands: Callable[[Any], None] | None = None  # adds its own subcommands to the `florist` command's subparsers
