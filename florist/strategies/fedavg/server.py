"""FedAvg's server half: the sample-weighted mean of the trained models (FedAvg+ differs only
on the client, which fine-tunes before testing)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from florist.common import packing, protocol
from florist.common.models import Net
from florist.server.strategy import TESTED, TRAINED, NodeInfo, ServerStrategy, mean_loss, metrics_of
from florist.strategies.base import Exchange
from florist.strategies.fedavg.spec import EVALUATE, TRAIN


def weighted_average(states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """Σ w_k·θ_k / Σ w_k for floating tensors; integer buffers (BatchNorm's counters) are
    taken from the client with the largest weight, since averaging a count means nothing."""
    total = float(sum(weights))
    heaviest = states[max(range(len(weights)), key=weights.__getitem__)]
    return {
        key: (
            sum(s[key].double() * (w / total) for s, w in zip(states, weights)).to(ref.dtype)
            if ref.is_floating_point()
            else heaviest[key].clone()
        )
        for key, ref in states[0].items()
    }


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

    def train_round(self, server_round: int, nodes: list[NodeInfo]) -> float | None:
        request = self.request(TRAIN, server_round, protocol.to_record(self.model))
        replies = self.broadcast(TRAIN, nodes, server_round, request, TRAINED, self.model.state_dict())
        done = [replies[n.node_id] for n in nodes if n.node_id in replies]  # fixed order: same seed, same sums
        if done:
            self.model.load_state_dict(
                weighted_average([r.arrays for r in done], [r.metrics["num-examples"] for r in done])
            )
        return mean_loss(r.metrics for r in done)

    def evaluate(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        """Send the global model with `evaluation`; clients personalize it their way."""
        request = self.request(self.evaluation, server_round, protocol.to_record(self.model))
        return metrics_of(self.broadcast(self.evaluation, nodes, server_round, request, TESTED))
