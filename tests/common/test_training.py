import numpy as np
import pytest
import torch

from florist.common import training
from florist.common.models import build_model


def _counted_model():
    model = build_model("mlp", (4,), 3)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    return model, calls


@pytest.mark.parametrize(("options", "expected"), [({"epochs": 2}, 6), ({"steps": 7}, 7), ({"steps": 2}, 2)])
def test_train_runs_whole_epochs_or_exactly_the_step_budget(options, expected):
    x, y = np.random.default_rng(0).random((10, 4), dtype=np.float32), np.arange(10) % 3
    model, calls = _counted_model()
    loss = training.train(model, x, y, batch_size=4, lr=0.1, generator=torch.Generator().manual_seed(0), **options)
    assert len(calls) == expected  # 10 samples in batches of 4: three batches per epoch
    assert np.isfinite(loss) and loss > 0
