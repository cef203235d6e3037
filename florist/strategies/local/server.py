"""Local's server half: it only tells the nodes when to train and to test."""

from __future__ import annotations

from florist.server.strategy import TESTED, NodeInfo, ServerStrategy, mean_loss, metrics_of
from florist.strategies.local.spec import EVALUATE_LOCAL, TRAIN_LOCAL


class Local(ServerStrategy):
    # Under record-level dp (its spec's `record_covered`) nothing a node trains leaves it: it trains as without
    # dp and spends no ε.

    def train_round(self, server_round: int, nodes: list[NodeInfo]) -> float | None:
        request = self.request(TRAIN_LOCAL, server_round)
        replies = self.broadcast(TRAIN_LOCAL, nodes, server_round, request, self.trained_metrics)
        return mean_loss(r.metrics for r in replies.values())

    def evaluate(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        # A node with no model yet (unseen, or never sampled) trains one with the seen nodes' budget.
        budget = max(1, self.cfg.num_server_rounds * self.cfg.local_epochs)
        request = self.request(EVALUATE_LOCAL, server_round, scratch_epochs=budget)
        return metrics_of(self.broadcast(EVALUATE_LOCAL, nodes, server_round, request, TESTED))
