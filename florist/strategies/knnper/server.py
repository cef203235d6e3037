"""kNN-Per's server half is FedAvg's, its aggregation (`aggregation`, `clip-norm`,
`max-node-examples`) included: only the evaluation exchange differs. Under `knn-train-on-val`
it runs the paper's two phases: at the first round of phase 2 it keeps phase 1's final model
(`chooser`, checkpointed) and restarts the global model from its initialisation; every
phase-2 evaluation of the seen nodes sends the chooser beside the current model, so each node
can make (or reuse) its phase-1 choice whenever it missed the end of phase 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from florist.common import protocol
from florist.common.models import Net
from florist.server.strategy import TESTED, NodeInfo, metrics_of
from florist.strategies.fedavg.server import FedAvg
from florist.strategies.knnper.spec import EVALUATE_KNNPER, TRAIN_KNNPER, in_phase_two, phase_rounds


class KnnPer(FedAvg):
    training = TRAIN_KNNPER
    evaluation = EVALUATE_KNNPER

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        rounds = self.cfg.num_server_rounds
        if self.settings.train_on_val and (rounds < 2 or rounds % 2):
            raise ValueError(
                f"knn-train-on-val runs two phases of num-server-rounds / 2 rounds: num-server-rounds must be "
                f"even and >= 2, got {rounds}"
            )
        self.chooser: Net | None = None  # phase 1's final model, in phase 2 of knn-train-on-val

    def before_training(self, server_round: int) -> None:
        """The first round of phase 2 keeps the global model as the chooser and starts again from
        the run's initialisation."""
        if self.settings.train_on_val and server_round == phase_rounds(self.settings, self.cfg.num_server_rounds) + 1:
            self.chooser, self.model = self.model, self.new_model()

    def evaluate(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        """The seen nodes' scores; in phase 2 with the chooser beside the global model."""
        side = None
        if in_phase_two(self.settings, self.cfg.num_server_rounds, server_round):
            # no chooser yet: training stopped before phase 2 (a dp budget), so the model is phase 1's
            side = protocol.to_record(self.chooser or self.model)
        request = self.request(self.evaluation, server_round, protocol.to_record(self.model), side=side)
        return metrics_of(self.broadcast(self.evaluation, nodes, server_round, request, TESTED))

    def serve(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        """Nodes that never trained choose on their validation split with the current model."""
        request = self.request(self.evaluation, server_round, protocol.to_record(self.model))
        return metrics_of(self.broadcast(self.evaluation, nodes, server_round, request, TESTED))

    def state(self) -> dict[str, Any]:
        chooser = {} if self.chooser is None else {"chooser": self.chooser.state_dict()}
        return super().state() | chooser

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        if "chooser" in state:
            self.chooser = self.new_model()
            self.chooser.load_state_dict(state["chooser"])


def report(results: dict[str, Any], folder: Path) -> list[str]:
    """λ chosen per client against its local training-set size (the kNN-Per paper's Fig. 8); a
    sentence instead where every client has the same λ (a flat line says nothing, and under
    `knn-select = "shrunk"` it is the prior: no validation split beat it)."""
    import matplotlib.pyplot as plt

    clients = [c for c in results["clients"] if c.get("lambda") is not None]
    lines = ["", "## λ per client", ""]  # a blank line first: right after a table, the plot was a row of it
    chosen = sorted({c["lambda"] for c in clients})
    if len(chosen) <= 1:
        cfg = results["config"]
        prior = cfg.get("knn-prior", "")
        why = (
            f", the prior (knn-prior {prior}): under knn-select {cfg.get('knn-select')} no client's validation "
            f"split favoured another λ by more than knn-prior-weight {cfg.get('knn-prior-weight')} samples"
            if chosen and cfg.get("knn-select") == "shrunk" and str(chosen[0]) == prior.split(",")[0].strip()
            else ""
        )
        said = f"Every client has λ = {chosen[0]:g}{why}." if chosen else "No client reported a λ."
        return [*lines, said + " No plot of λ against local data size.", ""]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, seen in (("seen", True), ("unseen", False)):
        rows = [c for c in clients if c["seen"] == seen]
        ax.scatter([c["num_train"] for c in rows], [c["lambda"] for c in rows], label=name, alpha=0.7)
    ax.set(
        xlabel="local training samples",
        ylabel="λ chosen on validation",
        ylim=(-0.05, 1.05),
        title=f"{results['strategy']}: λ vs local data size",
    )
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / "lambda_vs_size.png", dpi=120)
    plt.close(fig)
    return [*lines, "![lambda vs local data size](lambda_vs_size.png)", ""]


KnnPer.report = staticmethod(report)  # its section of report.md
