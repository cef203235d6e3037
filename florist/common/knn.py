"""kNN-Per's math (Marfoq et al., ICML 2022) as plain numpy functions.

    p_kNN(y | x) ∝ Σ_{i ∈ kNN(x)} 1{y_i = y} · exp(−d_i / σ)
    h(x)         = λ · p_kNN(y | x) + (1 − λ) · p_global(y | x)

Both terms are probabilities, so the mixture is one too (the reference code's default mixes
logits with probabilities, which is not a distribution; florist does not).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from florist.common.training import log_loss

LAMBDA_GRID = tuple(round(0.1 * i, 1) for i in range(11))


def knn_proba(distances: np.ndarray, labels: np.ndarray, num_classes: int, sigma: float) -> np.ndarray:
    """p_kNN for each query from its k neighbours' squared-L2 distances and labels (N×k each).

    Distances are shifted by each row's minimum before exponentiating: the shift cancels in
    the normalisation and keeps exp() from underflowing to an all-zero row.
    """
    weights = np.exp(-(distances - distances.min(axis=1, keepdims=True)) / sigma)
    proba = np.zeros((len(distances), num_classes))
    np.add.at(proba, (np.arange(len(distances))[:, None], labels), weights)
    return proba / proba.sum(axis=1, keepdims=True)


def mix(p_knn: np.ndarray, p_global: np.ndarray, lam: float) -> np.ndarray:
    """λ·p_kNN + (1 − λ)·p_global. λ = 0 returns p_global itself, bit for bit."""
    return p_global if lam == 0 else lam * p_knn + (1 - lam) * p_global


@dataclasses.dataclass(frozen=True)
class Choice:
    lam: float
    k: int
    accuracy: float
    loss: float


def select(
    p_global: np.ndarray, p_knn_by_k: dict[int, np.ndarray], y: np.ndarray, lambdas=LAMBDA_GRID
) -> Choice:
    """The (λ, k) with the best validation accuracy; ties broken by the lower validation
    log-loss, then by the smaller λ and k.

    Validation splits hold a few dozen samples, so many λ reach the same accuracy; the
    log-loss separates them by how much probability lands on the true labels, which picks the
    λ the data supports instead of defaulting to the smallest.
    """
    candidates = []
    for k, p_knn in sorted(p_knn_by_k.items()):
        for lam in lambdas:
            p = mix(p_knn, p_global, lam)
            candidates.append(Choice(lam, k, float((p.argmax(1) == y).mean()), log_loss(p, y)))
    return min(candidates, key=lambda c: (-c.accuracy, c.loss, c.lam, c.k))
