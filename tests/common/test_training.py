import numpy as np
import pytest
import torch

from florist.common import training
from florist.common.models import build_model, seeded_model


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


def _images(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 1, 28, 28), dtype=np.uint8), rng.integers(0, 10, n)


def _trained(x, y, **options):
    model = seeded_model("lenet", (1, 28, 28), 10, 0)
    loss = training.train(model, x, y, batch_size=16, lr=0.1, generator=torch.Generator().manual_seed(1), **options)
    return loss, model.state_dict()


def test_uint8_images_train_exactly_as_their_float_copies():
    """Images kept as uint8 become floats per batch: the same values as x / 255 stored in
    float32, so the same weights after training, bit for bit."""
    x, y = _images()
    every_byte = np.arange(256, dtype=np.uint8)
    assert np.array_equal(training.inputs(every_byte).numpy(), (every_byte / 255.0).astype(np.float32))
    loss_u8, state_u8 = _trained(x, y)
    loss_f32, state_f32 = _trained((x / 255.0).astype(np.float32), y)
    assert loss_u8 == loss_f32 and all(torch.equal(state_u8[k], state_f32[k]) for k in state_u8)


def test_augmentation_is_seeded_and_changes_training():
    x, y = _images()
    crop = lambda seed: training.augmenter("crop-flip", x.shape[1:], 1, 2, seed)  # noqa: E731
    first, again, other = (_trained(x, y, augment=crop(s)) for s in (3, 3, 4))
    plain = _trained(x, y)
    same = lambda a, b: all(torch.equal(a[1][k], b[1][k]) for k in a[1])  # noqa: E731
    assert same(first, again) and not same(first, other) and not same(first, plain)
    assert training.augmenter("none", x.shape[1:], 1) is None  # `none` trains exactly as before
    with pytest.raises(ValueError, match="works on images"):
        training.augmenter("flip", (60,), 1)


def test_a_crop_keeps_the_image_size_and_a_flip_mirrors_it():
    batch = torch.arange(2 * 1 * 4 * 4, dtype=torch.float32).reshape(2, 1, 4, 4)
    flipped = [training.augmenter("flip", (1, 4, 4), s)(batch) for s in range(8)]
    assert all(f.shape == batch.shape for f in flipped)
    for f in flipped:  # each sample is itself or its mirror image
        assert all(torch.equal(f[i], batch[i]) or torch.equal(f[i], batch[i].flip(-1)) for i in range(2))
    assert any(not torch.equal(f, batch) for f in flipped)
    cropped = training.augmenter("crop-flip", (1, 4, 4), 0)(batch)
    assert cropped.shape == batch.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; CI has none")
def test_training_on_cuda_gives_back_a_cpu_model_close_to_the_cpu_one():
    x, y = _images()
    loss_cpu, cpu = _trained(x, y)
    loss_gpu, gpu = _trained(x, y, device="cuda")
    assert all(v.device.type == "cpu" for v in gpu.values())
    assert abs(loss_cpu - loss_gpu) < 1e-3 and all(torch.allclose(cpu[k], gpu[k], atol=1e-3) for k in cpu)
