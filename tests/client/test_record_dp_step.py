"""DP-SGD's step is SGD's when nothing is clipped and no noise is drawn (docs/privacy.md, "Record-level
dp", *A step*): the per-sample path (layer hooks, clip factors, the sum over the expected batch) must
move the model exactly as autograd's mean loss over the same Poisson sample, scaled by the sample's
size over `batch-size`. A wrong denominator, a lost layer or a clip applied where none should be
fails it; so does a sample drawn differently from the one the step took."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from florist.common import training
from florist.common.models import seeded_model


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("name, shape", [("lenet", (1, 28, 28)), ("cnn", (1, 8, 8)), ("mlp", (1, 8, 8))])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_noiseless_unclipped_dp_sgd_step_is_sgd_on_the_samples_mean_loss_over_the_expected_batch(
    name, shape, momentum
):
    rng = np.random.default_rng(3)
    n, rate, batch_size, lr = 40, 0.3, 12, 0.5  # expected batch 12, the sample drawn holds some other count
    x = rng.random((n, *shape)).astype(np.float32)
    y = rng.integers(0, 10, n)
    sampler = torch.Generator().manual_seed(7)
    sample = training.poisson_sample(n, rate, torch.Generator().manual_seed(7))  # the step's own draw
    assert 0 < len(sample) != batch_size  # so the scale (sampled / batch-size) is not 1

    private = seeded_model(name, shape, 10, 1)
    settings = {"rate": rate, "clip": 1e9, "sigma": 0.0, "batch_size": batch_size, "momentum": momentum}
    training.train_private(private, x, y, steps=1, lr=lr, sampler=sampler, **settings)

    plain = seeded_model(name, shape, 10, 1)
    before = flat(plain)
    loss = F.cross_entropy(plain(training.inputs(x[sample.numpy()])), torch.from_numpy(y[sample.numpy()]))
    (loss * len(sample) / batch_size).backward()
    torch.optim.SGD(plain.parameters(), lr=lr, momentum=momentum).step()

    moved = flat(plain) - before
    assert float(moved.norm()) > 1e-3  # the step moved the model: the comparison is not of two no-ops
    assert torch.allclose(flat(private), flat(plain), rtol=1e-4, atol=1e-6)
