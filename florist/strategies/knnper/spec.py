"""kNN-Per (Marfoq et al., ICML 2022): the global model is FedAvg's, unchanged; each client
personalizes it at evaluation with its own FAISS datastore of (features(x), y) pairs,

    p_kNN(y | x) ∝ Σ_{i ∈ kNN(x)} 1{y_i = y} · exp(−d_i / σ)     (Eqs. 6 and 40, d Euclidean)
    h(x)         = λ · p_kNN(y | x) + (1 − λ) · p_global(y | x),

with λ, k and σ chosen per client on its validation split. With `knn-train-on-val` a run has
two phases of `num-server-rounds / 2` rounds each (the paper's protocol): the first trains on
the train splits and fixes each client's choice; the global model then restarts from its
initialisation and the second trains it on train + validation."""

from __future__ import annotations

import dataclasses

from florist.common.settings import Settings, setting
from florist.common.spec import Exchange, StrategySpec
from florist.strategies.knnper import commands

INDEX_TYPES = ("flat", "hnsw", "ivf")
POLICIES = ("concat", "fifo", "fixed")
KERNELS = ("paper", "squared")  # exp(−d/σ) on Euclidean d | exp(−d²/σ), florist's earlier kernel


@dataclasses.dataclass(frozen=True)
class KnnSettings(Settings):
    prefix = "knn"
    kernel: str = setting("paper")  # paper: exp(−d/σ), d Euclidean | squared: exp(−d²/σ)
    sigmas: str = setting("0.1,0.3,1,3,10")  # the σ grid each client chooses from on validation
    ks: str = setting("5,10")  # the k grid each client chooses from on validation
    index: str = setting("flat", node=True)  # FAISS index of the datastore: flat | hnsw | ivf
    capacity: int = setting(0)  # entries kept under the fifo / fixed policies
    policy: str = setting("concat")  # concat | fifo | fixed, when samples are added later
    train_on_val: bool = setting(False)  # the paper's protocol: two phases, the second trains on train + val

    @property
    def k_grid(self) -> tuple[int, ...]:
        return tuple(int(k) for k in self.ks.split(","))

    @property
    def sigma_grid(self) -> tuple[float, ...]:
        return tuple(float(s) for s in self.sigmas.split(","))

    def checks(self):
        return [
            (self.kernel in KERNELS, f"knn-kernel must be one of {', '.join(KERNELS)}"),
            (_positive_floats(self.sigmas), 'knn-sigmas must list positive numbers, e.g. "0.3,1,3"'),
            (
                all(p.strip().isdigit() and int(p) >= 1 for p in self.ks.split(",")),
                'knn-ks must list positive integers, e.g. "5,10"',
            ),
            (self.index in INDEX_TYPES, f"knn-index must be one of {', '.join(INDEX_TYPES)}"),
            (self.policy in POLICIES, f"knn-policy must be one of {', '.join(POLICIES)}"),
            (self.policy == "concat" or self.capacity >= 1, "knn-policy fifo/fixed needs knn-capacity >= 1"),
        ]


def _positive_floats(text: str) -> bool:
    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        return False
    return all(0 < v < float("inf") for v in values)


def phase_rounds(settings: KnnSettings, num_server_rounds: int) -> int:
    """The last round of phase 1 (the choice is made with that round's global model): half
    the run under `knn-train-on-val`, the whole run otherwise. Both halves derive the phase from
    the round number alone, so a resumed run and a restarted node agree on it."""
    return num_server_rounds // 2 if settings.train_on_val else num_server_rounds


def in_phase_two(settings: KnnSettings, num_server_rounds: int, server_round: int) -> bool:
    """Whether `server_round` trains on train + validation (and evaluates with the kept choice)."""
    return settings.train_on_val and server_round > phase_rounds(settings, num_server_rounds)


# FedAvg's training exchange, on the validation split too in phase 2 of `knn-train-on-val`.
TRAIN_KNNPER = Exchange("train.knnper")
# The global model down (in phase 2 also phase 1's, under `side`, for the choice); the
# mixture's test metrics up, with the chosen λ, k and σ.
EVALUATE_KNNPER = Exchange("evaluate.knnper")

KNNPER = StrategySpec(
    "knnper",
    "kNN-Per: FedAvg's model mixed with a local FAISS kNN",
    (TRAIN_KNNPER, EVALUATE_KNNPER),
    KnnSettings,
    commands=commands.add,
)
