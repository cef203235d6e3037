"""PerFed-CKT (Cho, Wang, Chiruvolu, Joshi, 2021): clients share only soft decisions on a
public unlabeled set P, never weights, so each may run its own architecture. A round
(Algorithm 1): the server sends the centroids of the last round's soft decisions; a client
picks the nearest centroid s̄_k and runs τ SGD steps on

    F_k(w) + λ/|P|·Σ_{x∈P} ‖s̄_k(x) − s(w, x)‖²,

with s(w, x) ∈ Δ_N the model's class probabilities (the sum estimated on mini-batches of b'
samples of P), then sends its new soft decisions s_k on P; the server clusters them with
k-means."""

from __future__ import annotations

import dataclasses

from florist.common.settings import Settings, setting
from florist.common.spec import Exchange, StrategySpec
from florist.strategies.perfedckt import commands, public

CENTROIDS = "centroids"  # c × |P| × C, down
SOFT = "soft-decisions"  # |P| × C, up


@dataclasses.dataclass(frozen=True)
class CktSettings(Settings):
    prefix = "ckt"
    clusters: int = setting(4, server=True)  # c, k-means clusters of the soft decisions (README: the c sweep)
    lambda_: float = setting(2.0, key="ckt-lambda")  # λ, weight of the distillation term (the paper's grid: 0.05-4)
    soft: str = setting("probs")  # s(w, x): class probabilities (the paper), or the raw logits
    public_batch: int = setting(128)  # b', samples of P per distillation step (the paper's 128)
    steps: int = setting(50)  # τ local iterations (0: local-epochs passes over the train split)
    public_dir: str = setting("", key="public-dir", node=True)  # a folder with P instead of public-dataset
    public_dataset: str = setting("same", key="public-dataset")  # P's source: same | digits | mnist5k (resized)
    public_shift: str = setting("none", key="public-shift")  # rotate:K: P upright (none) or in every cluster's view
    unseen: str = setting("rounds")  # a node without a model: rounds (local first, then distilled) | paper
    public_hash: str = setting("", key="public-hash", server=True)  # P's fingerprint when only nodes hold P
    client_models: str = setting("", key="client-models")  # architectures by partition id, cycling

    def checks(self):
        return [
            (
                all(self.client_models.split(",")) or not self.client_models,
                'client-models must list model names separated by commas, e.g. "cnn,mlp,cnn-wide"',
            ),
            (self.clusters >= 1, "ckt-clusters must be >= 1"),
            (self.lambda_ >= 0, "ckt-lambda must be >= 0"),
            (self.soft in ("logits", "probs"), "ckt-soft must be logits or probs"),
            (self.public_batch >= 1, "ckt-public-batch must be >= 1"),
            (self.steps >= 0, "ckt-steps must be >= 0 (0: local-epochs passes over the train split)"),
            (self.unseen in ("rounds", "paper"), "ckt-unseen must be rounds or paper"),
            *public.checks(self.public_dataset, self.public_shift),
        ]


@dataclasses.dataclass(frozen=True)
class PublicSettings(Settings):
    public_hash: str = setting("")  # the fingerprint of P every node must match
    scratch_rounds: int = setting(0)  # evaluate: a node without a model first trains this many rounds


TRAIN_CKT = Exchange("train.ckt", PublicSettings)  # centroids down, soft decisions up
EVALUATE_CKT = Exchange("evaluate.ckt", PublicSettings)  # the node's own model is tested

PERFED_CKT = StrategySpec(
    "perfed-ckt",
    "PerFed-CKT: clustered distillation on a public set, any architecture",
    (TRAIN_CKT, EVALUATE_CKT),
    CktSettings,
    commands=commands.add,
    record_covered=True,  # soft decisions on the public set from a DP-trained model: post-processing
)
