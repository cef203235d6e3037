"""FedAvg (McMahan et al., 2017) and FedAvg+ (the global model fine-tuned on each client's
train split before it is tested): the baselines personalization must beat. They use Flower's
standard `train` and `evaluate` messages, so Flower's own strategies drive florist clients too."""

from __future__ import annotations

import dataclasses

from florist.common.settings import Settings, setting
from florist.common.spec import Exchange, StrategySpec

TRAIN = Exchange("train")  # model down, trained model up
EVALUATE = Exchange("evaluate")  # model down, test metrics up
# Secure aggregation's four stages in place of TRAIN (`secure-aggregation = "secaggplus"`, also for kNN-Per's
# global model; docs/secure-aggregation.md): their payloads are the `secagg` records of florist/common/secagg_records.py
SECAGG_KEYS = Exchange("query.secagg_keys")  # this node's SecAgg id and the setup down, two public keys up
SECAGG_SHARES = Exchange("query.secagg_shares")  # every node's public keys down, shares encrypted for each up
TRAIN_SECAGG = Exchange("train.secagg")  # the model and the shares sent to this node down, the masked update up
SECAGG_UNMASK = Exchange("query.secagg_unmask")  # the survivors and the dropped down, shares of their secrets up
SECAGG = (SECAGG_KEYS, SECAGG_SHARES, TRAIN_SECAGG, SECAGG_UNMASK)


@dataclasses.dataclass(frozen=True)
class FinetuneSettings(Settings):
    """FedAvg+: how each client fine-tunes the global model before testing it."""

    prefix = "finetune"
    epochs: int = setting(5)
    lr: float = setting(0.05)

    def checks(self):
        return [(self.epochs >= 0, "finetune-epochs must be >= 0"), (self.lr > 0, "finetune-lr must be > 0")]


# Record-level dp covers both: the model they send is DP-SGD's (FedAvg+'s fine-tuning stays on the node).
FEDAVG = StrategySpec("fedavg", "FedAvg: one global model", (TRAIN, EVALUATE, *SECAGG), record_covered=True)
FEDAVG_FT = StrategySpec(
    "fedavg-ft",
    "FedAvg+: the global model fine-tuned on each client",
    (TRAIN, EVALUATE, *SECAGG),
    FinetuneSettings,
    record_covered=True,
)
