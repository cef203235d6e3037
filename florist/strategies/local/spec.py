"""Local: every client trains its own model on its own data; nothing is shared."""

from __future__ import annotations

import dataclasses

from florist.common.settings import Settings, setting
from florist.strategies.base import Exchange, StrategySpec


@dataclasses.dataclass(frozen=True)
class ScratchSettings(Settings):
    """A node with no model yet (unseen, or never sampled) trains one for this many epochs."""

    scratch_epochs: int = setting(1)


def _client():
    """The client half (imported on a node's first message: it imports torch)."""
    from florist.strategies.local import client

    return client


def _server():
    """The server half (imported when a run starts: it imports torch)."""
    from florist.strategies.local import server

    return server


TRAIN_LOCAL = Exchange("train.local", lambda: _client().train)  # nothing down, metrics up
EVALUATE_LOCAL = Exchange("evaluate.local", lambda: _client().evaluate, ScratchSettings)

LOCAL = StrategySpec("local", "Local: each client trains alone", lambda: _server().Local, (TRAIN_LOCAL, EVALUATE_LOCAL))
