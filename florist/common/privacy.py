"""The Gaussian mechanism for a served node's descriptor (OD-PFL, Section 7).

The descriptor is a mean of |D| unit vectors, so replacing one sample moves it by at most
Δg = 2/|D| in L2; adding ξ ~ N(0, σ²I) with σ² = 2·Δg²·log(1.25/δ)/ε² makes what the node
sends (ε, δ)-differentially private with respect to any one of its samples.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def gaussian_sigma(epsilon: float, delta: float, num_samples: int) -> float:
    """σ of the Gaussian mechanism for a mean of `num_samples` unit vectors (0 for ε = inf)."""
    if not epsilon > 0:
        raise ValueError(f"dp-epsilon must be > 0 (inf: no noise), got {epsilon}")
    if not 0 < delta < 1:
        raise ValueError(f"dp-delta must be in (0, 1), got {delta}")
    if num_samples < 1:
        raise ValueError("differential privacy needs at least one sample in the descriptor, got |D| = 0")
    if math.isinf(epsilon):
        return 0.0
    sensitivity = 2.0 / num_samples
    return math.sqrt(2.0 * sensitivity**2 * math.log(1.25 / delta)) / epsilon


def privatize(descriptor: torch.Tensor, sigma: float) -> torch.Tensor:
    """`descriptor + ξ`, ξ ~ N(0, σ²I) drawn from fresh OS entropy: a seeded generator would
    let anyone who knows the run's seed subtract the noise again."""
    noise = np.random.default_rng().normal(0.0, sigma, size=tuple(descriptor.shape))
    return descriptor + torch.from_numpy(noise).to(descriptor.dtype)
