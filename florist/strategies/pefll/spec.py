"""PeFLL (Scott, Zakerinia, Lampert, ICLR 2024) and OD-PFL as ODPFL-HN ("On-Demand Unlabeled
Personalized Federated Learning"). An encoder describes a client by its data (PeFLL: labelled
pairs; OD-PFL: unlabeled samples only), a hypernetwork h maps the descriptor v to the client's
model θ. A training round is three exchanges (Algorithm 2):

1. `query.describe`: the encoder η_v down, the descriptor v up;
2. `train.generated`: θ = h(v) down, Δθ after k local SGD steps (OD-PFL: or E epochs) up;
3. `train.encoder`: Δv = (∂θ/∂v)ᵀΔθ down, Δη_v = (∂v/∂η_v)ᵀΔv up.

A client that never trained gets its model from one descriptor and one forward pass of h
(`query.describe` then `evaluate.generated`). Under OD-PFL a served node may add Gaussian noise
to its descriptor for (ε, δ)-differential privacy."""

from __future__ import annotations

import dataclasses
import math

from florist.common.settings import Settings, setting
from florist.common.spec import Exchange, StrategySpec

DESCRIPTOR = "descriptor"  # the array key of v (up, exchange 1) and of Δv (down, exchange 3)
# `hn-class-means`: the side arrays of exchange 1's reply (`networks.class_statistics`)
MEANS, COUNTS, VARIANCE = "class-means", "class-counts", "class-variance"
ENCODERS = ("label-channels", "trunk", "slots", "paper")  # PeFLL's embedding networks (`networks.EmbeddingNet`)
OPTIMIZERS = ("sgd", "adam", "adamw")  # the server's step on the pseudo-gradient −mean Δη


@dataclasses.dataclass(frozen=True)
class HyperNetSettings(Settings):
    prefix = "hn"
    embed_dim: int = setting(0, server=True)  # descriptor size l (0: 1 + n/4, n = training clients)
    batch: int = setting(32)  # samples per descriptor while training (OD-PFL encodes all)
    local_steps: int = setting(50)  # client SGD steps k per round
    hidden: int = setting(100, server=True)  # hypernetwork hidden width
    encoder: str = setting("label-channels")  # PeFLL's φ, one of ENCODERS (networks.EmbeddingNet)
    optimizer: str = setting("adamw", server=True)  # adamw (florist's) | adam (the authors') | sgd (Alg. 2)
    server_lr: float = setting(5e-3, server=True)  # server step s (Algorithm 2's β is the clients' step)
    grad_clip: float = setting(0.0, server=True)  # max norm of the server's update direction (0: off)
    standardize: bool = setting(False, server=True)  # v ← (v − m)/s, m, s: medians over round 1's nodes
    standardize_components: bool = setting(False, server=True)  # v ← (v − m)/s per component, refit each round
    class_means: bool = setting(True)  # PeFLL's h also reads the nodes' class-conditional means (networks.ClassMeans)
    l2_hyper: float = setting(1e-3, server=True)  # λ_h
    l2_embed: float = setting(1e-3, server=True)  # λ_v
    l2_model: float = setting(5e-5)  # λ_θ, the client's ‖θ‖² penalty
    encode_batch: int = setting(256, key="odpfl-encode-batch")  # samples encoded at once (the mean is exact)

    def checks(self):
        return [
            (self.embed_dim >= 0, "hn-embed-dim must be >= 0 (0: 1 + n/4)"),
            (
                min(self.batch, self.local_steps, self.hidden) >= 1,
                "hn-batch, hn-local-steps and hn-hidden must be >= 1",
            ),
            (self.encoder in ENCODERS, f"hn-encoder must be one of {', '.join(ENCODERS)}"),
            (self.optimizer in OPTIMIZERS, f"hn-optimizer must be one of {', '.join(OPTIMIZERS)}"),
            (
                not (self.standardize and self.standardize_components),
                "hn-standardize and hn-standardize-components are two ways to standardize descriptors: set one",
            ),
            (self.server_lr > 0, "hn-server-lr must be > 0"),
            (self.grad_clip >= 0, "hn-grad-clip must be >= 0 (0: off)"),
            (min(self.l2_hyper, self.l2_embed, self.l2_model) >= 0, "hn-l2-* must be >= 0"),
            (self.encode_batch >= 1, "odpfl-encode-batch must be >= 1"),
        ]

    @property
    def schedule(self) -> tuple[int, int | None]:
        """(epochs, steps) of a client's message 2, as `Node.fit` takes them: k steps (Algorithm 2)."""
        return 1, self.local_steps

    @property
    def reads_class_means(self) -> bool:
        """Whether nodes send, and h reads, class-conditional means (`hn-class-means`)."""
        return self.class_means


@dataclasses.dataclass(frozen=True)
class OnDemandSettings(HyperNetSettings):
    """OD-PFL adds the Gaussian noise of a served node's descriptor (a node may set its own)."""

    dp_epsilon: float = setting(math.inf, key="dp-epsilon", node=True)  # ε (inf: no noise)
    dp_delta: float = setting(1e-5, key="dp-delta", node=True)  # δ
    normalize: str = setting("always", key="odpfl-normalize", server=True)  # φ on the unit sphere: always | dp
    psi: str = setting("identity", key="odpfl-psi")  # ψ after the mean: identity | mlp (the paper's DS)
    local_epochs: int = setting(0, key="odpfl-local-epochs")  # E passes a round, Algorithm 1 (0: hn-local-steps)

    def checks(self):
        return super().checks() + [
            (self.dp_epsilon > 0, "dp-epsilon must be > 0 (inf: no noise)"),
            (0 < self.dp_delta < 1, "dp-delta must be in (0, 1)"),
            (self.normalize in ("always", "dp"), "odpfl-normalize must be always or dp"),
            (self.psi in ("identity", "mlp"), "odpfl-psi must be identity or mlp"),
            (self.local_epochs >= 0, "odpfl-local-epochs must be >= 0 (0: hn-local-steps steps)"),
        ]

    @property
    def schedule(self) -> tuple[int, int | None]:
        """Algorithm 1's E passes over the train split when `odpfl-local-epochs` is set, else
        PeFLL's k steps (florist's default, so that a run without the key is unchanged)."""
        return (self.local_epochs, None) if self.local_epochs else super().schedule

    @property
    def reads_class_means(self) -> bool:
        """Never: OD-PFL's descriptors read no labels, whatever `hn-class-means` says."""
        return False

    @property
    def normalized(self) -> bool:
        """Whether φ's outputs go on the unit sphere in this run: always, or (`dp`, the paper's
        choice) when the run's `dp-epsilon` is finite. A node that noises its descriptor
        normalises whatever the run says: its privacy never rests on the server."""
        return self.normalize == "always" or math.isfinite(self.dp_epsilon)


@dataclasses.dataclass(frozen=True)
class DescribeSettings(Settings):
    embed_dim: int = setting(1)
    predict: bool = setting(False)  # describe by the whole train split (PeFLL-predict)
    serve: bool = setting(False)  # the node is being served (OD-PFL: it may add noise)
    normalize: bool = setting(True)  # OD-PFL: φ's outputs on the unit sphere (`odpfl-normalize`)


@dataclasses.dataclass(frozen=True)
class BackpropSettings(Settings):
    embed_dim: int = setting(1)
    normalize: bool = setting(True)  # OD-PFL: as in the round's describe


DESCRIBE = Exchange("query.describe", DescribeSettings)
TRAIN_GENERATED = Exchange("train.generated")
TRAIN_ENCODER = Exchange("train.encoder", BackpropSettings)
EVALUATE_GENERATED = Exchange("evaluate.generated")  # θ = h(v) down, kept and tested
EXCHANGES = (DESCRIBE, TRAIN_GENERATED, TRAIN_ENCODER, EVALUATE_GENERATED)

# Why record-level dp refuses both.
RECORD_GAP = (
    "the descriptor a node sends (its data embedded) and its hypernetwork gradient depend on its data outside "
    "DP-SGD's steps, and no noise bounds them"
)
PEFLL = StrategySpec(
    "pefll",
    "PeFLL: a hypernetwork maps each client's descriptor to its model",
    EXCHANGES,
    HyperNetSettings,
    record_gap=RECORD_GAP,
)
ODPFL = StrategySpec(
    "odpfl",
    "OD-PFL: PeFLL's shape on unlabeled descriptors, optionally private",
    EXCHANGES,
    OnDemandSettings,
    record_gap=RECORD_GAP,
)
