"""Local: every client trains its own model on its own data; nothing is shared."""

from __future__ import annotations

import dataclasses

from florist.algorithms.base import Exchange, Settings, Spec, setting


@dataclasses.dataclass(frozen=True)
class Scratch(Settings):
    """A node with no model yet (unseen, or never sampled) trains one for this many epochs."""

    scratch_epochs: int = setting(1)


TRAIN_LOCAL = Exchange("train.local", "florist.algorithms.local.client:train")  # nothing down, metrics up
EVALUATE_LOCAL = Exchange("evaluate.local", "florist.algorithms.local.client:evaluate", Scratch)

LOCAL = Spec(
    "local", "Local: each client trains alone", "florist.algorithms.local.server:Local", (TRAIN_LOCAL, EVALUATE_LOCAL)
)
