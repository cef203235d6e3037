"""Local: every client trains its own model on its own data; nothing is shared."""

from __future__ import annotations

import dataclasses

from florist.common.settings import Settings, setting
from florist.common.spec import Exchange, StrategySpec


@dataclasses.dataclass(frozen=True)
class ScratchSettings(Settings):
    """A node with no model yet (unseen, or never sampled) trains one for this many epochs."""

    scratch_epochs: int = setting(1)


TRAIN_LOCAL = Exchange("train.local")  # nothing down, metrics up
EVALUATE_LOCAL = Exchange("evaluate.local", ScratchSettings)

LOCAL = StrategySpec(
    "local",
    "Local: each client trains alone",
    (TRAIN_LOCAL, EVALUATE_LOCAL),
    record_covered=True,  # nothing sent
)
