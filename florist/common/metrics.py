"""Summaries of per-client accuracies, as in the papers' tables."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def weighted_mean(values: Sequence[float], weights: Sequence[float]) -> float:
    """Mean of `values` weighted by `weights` (e.g. test-set sizes); NaN when empty.

    `math.fsum` makes the result independent of the order replies arrived in."""
    total = math.fsum(weights)
    return math.fsum(v * w for v, w in zip(values, weights)) / total if len(values) and total > 0 else float("nan")


def bottom_decile(values: Sequence[float]) -> float:
    """The 10th-percentile client: the value at rank floor(0.1·(n−1)) in ascending order.

    Taking an actual client's accuracy (numpy's "lower" method) instead of interpolating keeps
    the number meaningful for the small federations this runs on.
    """
    return float(np.percentile(values, 10, method="lower")) if len(values) else float("nan")


def summarize(accuracies: Sequence[float], num_test: Sequence[int]) -> dict[str, float | int]:
    """`mean_accuracy` (test-size weighted), `bottom_decile_accuracy`, `num_clients`."""
    return {
        "mean_accuracy": weighted_mean(accuracies, num_test),
        "bottom_decile_accuracy": bottom_decile(accuracies),
        "num_clients": len(accuracies),
    }
