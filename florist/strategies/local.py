"""Local: every client trains its own model on its own data; nothing is shared."""

from __future__ import annotations

from florist.common import protocol
from florist.strategies.base import TESTED, TRAINED, NodeInfo, Strategy, mean_loss, metrics_of


class Local(Strategy):
    name = "local"

    def train_round(self, server_round: int, nodes: list[NodeInfo]) -> float | None:
        request = protocol.content(config=self.client_config(server_round))
        replies = self.broadcast(nodes, protocol.TRAIN_LOCAL, server_round, request, TRAINED)
        return mean_loss(r.metrics for r in replies.values())

    def evaluate(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        # A node with no model yet (unseen, or never sampled) trains one with the seen nodes' budget.
        budget = max(1, self.cfg.num_server_rounds * self.cfg.local_epochs)
        request = protocol.content(config=self.client_config(server_round, scratch_epochs=budget))
        return metrics_of(self.broadcast(nodes, protocol.EVALUATE_LOCAL, server_round, request, TESTED))
