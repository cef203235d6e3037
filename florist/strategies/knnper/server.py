"""kNN-Per's server half is FedAvg's, its aggregation (`aggregation`, `clip-norm`,
`max-node-examples`) included: only the evaluation exchange differs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from florist.strategies.fedavg.server import FedAvg
from florist.strategies.knnper.spec import EVALUATE_KNNPER


class KnnPer(FedAvg):
    evaluation = EVALUATE_KNNPER


def report(results: dict[str, Any], folder: Path) -> list[str]:
    """λ chosen per client against its local training-set size (the kNN-Per paper's Fig. 8)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, seen in (("seen", True), ("unseen", False)):
        rows = [c for c in results["clients"] if c["seen"] == seen and c.get("lambda") is not None]
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
    return ["![lambda vs local data size](lambda_vs_size.png)", ""]
