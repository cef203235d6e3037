"""kNN-Per (Marfoq et al., ICML 2022): the global model is FedAvg's, unchanged; each client
personalizes it at evaluation with its own FAISS datastore of (features(x), y) pairs,

    p_kNN(y | x) ∝ Σ_{i ∈ kNN(x)} 1{y_i = y} · exp(−d_i / σ)     (Eqs. 6 and 40, d Euclidean)
    h(x)         = λ · p_kNN(y | x) + (1 − λ) · p_global(y | x),

with λ, k and σ chosen per client on its validation split under `knn-select`: `client` (the
best of the grids), `paper` (k and σ fixed at `knn-prior`'s, λ chosen: the paper fixes k = 10)
or `shrunk` (the grids' best only where it beats the prior `knn-prior` by more than
`knn-prior-weight` validation samples: a few dozen digits cannot tell the grid's candidates
apart, and their best overfits them). With `knn-train-on-val` a run has two phases of
`num-server-rounds / 2` rounds each: the first trains on the train splits and fixes each
client's choice; the global model then restarts from its initialisation and the second trains
it on train + validation (the paper retrains on train + validation with its whole budget;
halving it is florist's)."""

from __future__ import annotations

import dataclasses

from florist.common.settings import Settings, setting
from florist.common.spec import Exchange, StrategySpec
from florist.strategies.knnper import commands

INDEX_TYPES = ("flat", "hnsw", "ivf")
POLICIES = ("concat", "fifo", "fixed")
KERNELS = ("paper", "squared")  # exp(−d/σ) on Euclidean d | exp(−d²/σ), florist's earlier kernel
SELECTIONS = ("client", "paper", "shrunk")  # how each client chooses (λ, k, σ): see the module's docstring


@dataclasses.dataclass(frozen=True)
class KnnSettings(Settings):
    prefix = "knn"
    kernel: str = setting("paper")  # paper: exp(−d/σ), d Euclidean | squared: exp(−d²/σ)
    sigmas: str = setting("0.1,0.3,1,3,10")  # the σ grid each client chooses from on validation
    ks: str = setting("5,10")  # the k grid each client chooses from on validation
    select: str = setting("shrunk")  # client: the grids' best | paper: k, σ of the prior, λ chosen | shrunk
    prior: str = setting("0.5,10,1")  # λ,k,σ: the paper's k = 10, what `shrunk` falls back to
    prior_weight: float = setting(5.0)  # shrunk: the validation samples a candidate must beat the prior by
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

    @property
    def prior_choice(self) -> tuple[float, int, float]:
        """`knn-prior` as (λ, k, σ)."""
        lam, k, sigma = self.prior.split(",")
        return float(lam), int(k), float(sigma)

    @property
    def pairs(self) -> tuple[tuple[int, float], ...]:
        """The (k, σ) a client chooses among: the prior's alone under `paper`, the grids'
        (with the prior's under `shrunk`) otherwise."""
        _, k, sigma = self.prior_choice
        if self.select == "paper":
            return ((k, sigma),)
        grid = tuple((k_, s) for k_ in self.k_grid for s in self.sigma_grid)
        return grid + (((k, sigma),) if self.select == "shrunk" and (k, sigma) not in grid else ())

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
            (self.select in SELECTIONS, f"knn-select must be one of {', '.join(SELECTIONS)}"),
            (_prior_ok(self.prior), 'knn-prior must be λ,k,σ with 0 <= λ <= 1, k >= 1 and σ > 0, e.g. "0.5,10,1"'),
            (self.prior_weight >= 0, "knn-prior-weight must be >= 0 (validation samples)"),
        ]


def _positive_floats(text: str) -> bool:
    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        return False
    return all(0 < v < float("inf") for v in values)


def _prior_ok(text: str) -> bool:
    """Whether `text` is λ,k,σ: a mixture weight in [0, 1], a k >= 1 and a σ > 0."""
    parts = text.split(",")
    if len(parts) != 3 or not parts[1].strip().isdigit() or not _positive_floats(parts[2]):
        return False
    try:
        lam = float(parts[0])
    except ValueError:
        return False
    return 0 <= lam <= 1 and int(parts[1]) >= 1


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
    record_covered=True,  # its global model is DP-SGD's; the datastore never leaves the node
)
