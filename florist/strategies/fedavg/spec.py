"""FedAvg (McMahan et al., 2017) and FedAvg+ (the global model fine-tuned on each client's
train split before it is tested): the baselines personalization must beat. They use Flower's
standard `train` and `evaluate` messages, so Flower's own strategies drive florist clients too."""

from __future__ import annotations

import dataclasses

from florist.common.settings import Settings, setting
from florist.common.spec import Exchange, StrategySpec

TRAIN = Exchange("train")  # model down, trained model up
EVALUATE = Exchange("evaluate")  # model down, test metrics up


@dataclasses.dataclass(frozen=True)
class FinetuneSettings(Settings):
    """FedAvg+: how each client fine-tunes the global model before testing it."""

    prefix = "finetune"
    epochs: int = setting(5)
    lr: float = setting(0.05)

    def checks(self):
        return [(self.epochs >= 0, "finetune-epochs must be >= 0"), (self.lr > 0, "finetune-lr must be > 0")]


FEDAVG = StrategySpec("fedavg", "FedAvg: one global model", (TRAIN, EVALUATE))
FEDAVG_FT = StrategySpec(
    "fedavg-ft",
    "FedAvg+: the global model fine-tuned on each client",
    (TRAIN, EVALUATE),
    FinetuneSettings,
)
