"""FedAvg (McMahan et al., 2017) and FedAvg+ (the global model fine-tuned on each client's
train split before it is tested): the baselines personalization must beat. They use Flower's
standard `train` and `evaluate` messages, so Flower's own strategies drive florist clients too."""

from __future__ import annotations

import dataclasses

from florist.algorithms.base import Exchange, Settings, Spec, setting

TRAIN = Exchange("train", "florist.algorithms.fedavg.client:train")  # model down, trained model up
EVALUATE = Exchange("evaluate", "florist.algorithms.fedavg.client:evaluate")  # model down, test metrics up


@dataclasses.dataclass(frozen=True)
class Finetune(Settings):
    """FedAvg+: how each client fine-tunes the global model before testing it."""

    prefix = "finetune"
    epochs: int = setting(5)
    lr: float = setting(0.05)

    def checks(self):
        return [(self.epochs >= 0, "finetune-epochs must be >= 0"), (self.lr > 0, "finetune-lr must be > 0")]


FEDAVG = Spec("fedavg", "FedAvg: one global model", "florist.algorithms.fedavg.server:FedAvg", (TRAIN, EVALUATE))
FEDAVG_FT = Spec(
    "fedavg-ft",
    "FedAvg+: the global model fine-tuned on each client",
    "florist.algorithms.fedavg.server:FedAvg",
    (TRAIN, EVALUATE),
    Finetune,
)
