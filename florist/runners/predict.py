"""`florist predict`: a node's kept model (`client/personal.py`) applied to samples, the way
the run's evaluation applied it, so that on the node's test split it scores exactly the
accuracy the run reported."""

from __future__ import annotations

import numpy as np

from florist.apps.client import PREDICTORS
from florist.client.personal import Kept
from florist.common import training


def probabilities(kept: Kept, x: np.ndarray) -> np.ndarray:
    """Class probabilities (N×C) of the kept model for samples `x` (N×input shape), on the CPU."""
    if tuple(x.shape[1:]) != kept.input_shape:
        raise ValueError(
            f"samples of shape {tuple(x.shape[1:])}, but the model of node {kept.manifest['node_key']} "
            f"(run {kept.manifest['run_id']}) expects {kept.input_shape}"
        )
    model = kept.network()
    predictor = PREDICTORS.get(kept.manifest["strategy"])
    return predictor(kept, model, x) if predictor else training.predict_proba(model, x)
