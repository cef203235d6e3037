"""What a strategy declares, shared by its two halves: its exchanges (message types) and its
settings section (`common/settings.py`). The halves themselves (the client functions that answer
each message type, the server half that sends them) are paired with these declarations in one
place, `florist/apps/`. Nothing here imports torch, so a run config is checked in milliseconds."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from florist.common.settings import NoSettings, Settings


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One message type: its Flower name (`category` or `category.action`) and the settings its
    request carries beside the run's (a `Settings` subclass without prefix: the handler's
    `request.settings`). The client function that answers it is listed by this name in
    `florist/apps/client.py`."""

    message_type: str
    settings: type[Settings] = NoSettings


# Why record-level dp (`dp = "record"`) refuses a strategy that does not say otherwise (`StrategySpec.record_gap`).
RECORD_GAP = "a value it sends depends on the node's data outside DP-SGD's steps"

# Every run starts with it, whatever the algorithm: the node's data sizes, shape, seen/unseen.
INFO = Exchange("query.info")


@dataclasses.dataclass(frozen=True)
class StrategySpec:
    """An algorithm as both halves and the rest of florist see it."""

    name: str  # what `strategy` and `--strategy` take
    summary: str  # one line for help texts
    exchanges: tuple[Exchange, ...]
    settings: type[Settings] = NoSettings
    commands: Callable[[Any], None] | None = None  # adds its own subcommands to the `florist` command's subparsers
    # Whether `dp = "record"` covers it: every message it sends derived from a node's data is DP-SGD's output
    # (or post-processing of it, or noised and counted as a DP-SGD step). When not, `record_gap` says why in
    # one line, and a run config naming both is refused as it is parsed, before torch is imported
    # (`RunConfig.checks`; the server half checks again: `ServerStrategy`).
    record_covered: bool = False
    record_gap: str = RECORD_GAP
