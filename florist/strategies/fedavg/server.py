"""FedAvg's server half: the sample-weighted mean of the trained models (FedAvg+ differs only
on the client, which fine-tunes before testing), or the robust rule the run config names
(`aggregation`, `clip-norm`, `max-node-examples`: florist/server/aggregation.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from florist.common import packing, protocol
from florist.common.models import Net
from florist.common.spec import Exchange
from florist.server.aggregation import Aggregator
from florist.server.strategy import TESTED, TRAINED, NodeInfo, Reply, ServerStrategy, mean_loss, metrics_of
from florist.strategies.fedavg.spec import EVALUATE, TRAIN


def exchange_bytes(model: Net, config: Mapping[str, Any]) -> tuple[int, int]:
    """(up, down) bytes of one client's FedAvg training exchange with `model`, measured on the
    messages FedAvg builds: the yardstick for strategies that send less."""
    request = protocol.content(protocol.to_record(model), config)
    reply = protocol.content(protocol.to_record(model), metrics={"num-examples": 1, "train-loss": 0.0})
    return protocol.nbytes(packing.pack(reply)), protocol.nbytes(packing.pack(request))


class FedAvg(ServerStrategy):
    """Sample-weighted FedAvg on Flower's standard `train` / `evaluate` messages."""

    evaluation: Exchange = EVALUATE  # kNN-Per personalizes at evaluation with its own exchange
    checkpointed = ("model",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model = self.new_model()
        self.aggregator = Aggregator.of(self.cfg)
        self.extras: dict[str, Any] = {}

    def train_round(self, server_round: int, nodes: list[NodeInfo]) -> float | None:
        request = self.request(TRAIN, server_round, protocol.to_record(self.model))
        replies = self.broadcast(TRAIN, nodes, server_round, request, TRAINED, self.model.state_dict())
        done = [(n, replies[n.node_id]) for n in nodes if n.node_id in replies]  # fixed order: same seed, same sums
        return self.aggregate(done)

    def aggregate(self, done: list[tuple[NodeInfo, Reply]]) -> float | None:
        """Load the aggregate of the `done` nodes' models into the global model (each node's
        weight capped by what it reported at discovery); return their weighted mean loss."""
        weights = [self.aggregator.weight(r.metrics["num-examples"], n.num_train) for n, r in done]
        self.extras = {}
        if done:
            outcome = self.aggregator([r.arrays for _, r in done], weights, self.model.state_dict())
            self.model.load_state_dict(outcome.state)
            if not self.aggregator.plain:
                self.extras = outcome.row([n.key for n, _ in done])
        return mean_loss(r.metrics | {"num-examples": w} for (_, r), w in zip(done, weights))

    def round_extras(self) -> dict[str, Any]:
        """Under a robust rule: the rule that ran, why it is not the one the run names (or what
        it did not count; "" when nothing), and the nodes it left out or clipped."""
        return self.extras

    def evaluate(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        """Send the global model with `evaluation`; clients personalize it their way."""
        request = self.request(self.evaluation, server_round, protocol.to_record(self.model))
        return metrics_of(self.broadcast(self.evaluation, nodes, server_round, request, TESTED))
