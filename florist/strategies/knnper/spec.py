"""kNN-Per (Marfoq et al., ICML 2022): the global model is FedAvg's, unchanged; each client
personalizes it at evaluation with its own FAISS datastore of (features(x), y) pairs,

    p_kNN(y | x) ∝ Σ_{i ∈ kNN(x)} 1{y_i = y} · exp(−d_i / σ)
    h(x)         = λ · p_kNN(y | x) + (1 − λ) · p_global(y | x),

with λ and k chosen per client on its validation split."""

from __future__ import annotations

import dataclasses

from florist.common.settings import Settings, setting
from florist.strategies.base import Exchange, StrategySpec
from florist.strategies.fedavg.spec import TRAIN
from florist.strategies.knnper import commands

INDEX_TYPES = ("flat", "hnsw", "ivf")
POLICIES = ("concat", "fifo", "fixed")


@dataclasses.dataclass(frozen=True)
class KnnSettings(Settings):
    prefix = "knn"
    sigma: float = setting(1.0)  # σ of p_kNN, over squared L2 distances
    ks: str = setting("5,10")  # the k grid each client chooses from on validation
    index: str = setting("flat", node=True)  # FAISS index of the datastore: flat | hnsw | ivf
    capacity: int = setting(0)  # entries kept under the fifo / fixed policies
    policy: str = setting("concat")  # concat | fifo | fixed, when samples are added later

    @property
    def k_grid(self) -> tuple[int, ...]:
        return tuple(int(k) for k in self.ks.split(","))

    def checks(self):
        return [
            (self.sigma > 0, "knn-sigma must be > 0"),
            (
                all(p.strip().isdigit() and int(p) >= 1 for p in self.ks.split(",")),
                'knn-ks must list positive integers, e.g. "5,10"',
            ),
            (self.index in INDEX_TYPES, f"knn-index must be one of {', '.join(INDEX_TYPES)}"),
            (self.policy in POLICIES, f"knn-policy must be one of {', '.join(POLICIES)}"),
            (self.policy == "concat" or self.capacity >= 1, "knn-policy fifo/fixed needs knn-capacity >= 1"),
        ]


def _client():
    """The client half (imported on a node's first message: it imports torch)."""
    from florist.strategies.knnper import client

    return client


def _server():
    """The server half (imported when a run starts: it imports torch)."""
    from florist.strategies.knnper import server

    return server


# The global model down; the mixture's test metrics up, with the chosen λ and k.
EVALUATE_KNNPER = Exchange("evaluate.knnper", lambda: _client().evaluate)

KNNPER = StrategySpec(
    "knnper",
    "kNN-Per: FedAvg's model mixed with a local FAISS kNN",
    lambda: _server().KnnPer,
    (TRAIN, EVALUATE_KNNPER),
    KnnSettings,
    report=lambda: _server().report,
    commands=commands.add,
)
