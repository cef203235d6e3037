"""Local training and evaluation as plain functions: numpy in, numbers out, no Flower types.

Samples stay as they were stored (uint8 images, float32 features) and become float32 on the
model's device one batch at a time (`inputs`); a model is moved to `device` for the call and
back to the CPU after it, so the caller's state dicts are always CPU tensors."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def seeded_generator(*seed: int) -> torch.Generator:
    """A torch generator seeded from several integers (run seed, round, client...)."""
    mixed = np.random.SeedSequence(list(seed)).generate_state(1)[0]
    return torch.Generator().manual_seed(int(mixed))


def inputs(x: np.ndarray, device: torch.device | str = "cpu") -> torch.Tensor:
    """Samples as the model reads them: float32 on `device`, uint8 images scaled to [0, 1]
    (the same float32 values `x / 255` gives in numpy, so uint8 and float storage agree)."""
    batch = torch.from_numpy(x if x.flags.writeable else np.array(x)).to(device)  # memory maps are read-only
    return batch.float().div_(255.0) if batch.dtype == torch.uint8 else batch.float()


@contextlib.contextmanager
def on_device(model: nn.Module, device: torch.device | str) -> Iterator[torch.device]:
    """`model` on `device` inside the block, back on the CPU after it (a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cpu":
        yield device
        return
    model.to(device)
    try:
        yield device
    finally:
        model.to("cpu")


def augmenter(kind: str, shape: tuple[int, ...], *seed: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Per-sample augmentation of float image batches (N×C×H×W) with torchvision's
    `transforms.v2`: `flip` (horizontal, p = 0.5) or `crop-flip` (pad 4, random crop back to
    H×W, flip: the CIFAR standard); None for `none`. Its draws come from its own generator
    seeded by `seed`, so the shuffling is the same with and without it and a run repeats."""
    if kind == "none":
        return None
    if kind not in ("flip", "crop-flip"):
        raise ValueError(f"augment {kind!r} is not one of none, flip, crop-flip")
    if len(shape) != 3:
        raise ValueError(f"augment {kind!r} works on images, but the samples have shape {shape}")
    from torchvision.transforms import v2

    steps = [v2.RandomHorizontalFlip()]
    if kind == "crop-flip":
        steps.insert(0, v2.RandomCrop(shape[1:], padding=4))
    transform = v2.Compose(steps)
    state = seeded_generator(*seed).get_state()

    def augment(batch: torch.Tensor) -> torch.Tensor:
        nonlocal state
        with torch.random.fork_rng(devices=[]):  # v2 draws from torch's default generator
            torch.random.set_rng_state(state)
            out = torch.stack([transform(sample) for sample in batch.cpu()]).to(batch.device)
            state = torch.random.get_rng_state()
        return out

    return augment


def train(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int = 1,
    steps: int | None = None,
    batch_size: int,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    generator: torch.Generator | None = None,
    penalty: Callable[[nn.Module], torch.Tensor] | None = None,
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
    device: torch.device | str = "cpu",
) -> float:
    """Mini-batch SGD on cross-entropy (plus `penalty(model)` at every step when given) for
    `epochs` passes, or for exactly `steps` mini-batches when given (reshuffling at each pass),
    on `device`, each batch through `augment` when given. Returns the mean loss over the last
    pass (or over all steps)."""
    if len(x) == 0:
        raise ValueError("cannot train on an empty set")
    loss_sum, seen = 0.0, 0
    count = steps if steps is not None else epochs * math.ceil(len(x) / batch_size)
    with on_device(model, device) as device:
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
        targets = torch.from_numpy(np.array(y)).to(device)  # a copy: memory-mapped labels are read-only
        for batch in itertools.islice(batches(len(x), batch_size, generator), count):
            if steps is None and seen >= len(x):  # a new epoch: report the last one only
                loss_sum, seen = 0.0, 0
            optimizer.zero_grad()
            samples = inputs(x[batch.numpy()], device)
            loss = F.cross_entropy(model(augment(samples) if augment else samples), targets[batch.to(device)])
            if penalty is not None:
                loss = loss + penalty(model)
            loss.backward()
            optimizer.step()
            loss_sum, seen = loss_sum + loss.item() * len(batch), seen + len(batch)
    if not np.isfinite(loss_sum):
        raise FloatingPointError(f"training diverged (loss {loss_sum}); lower lr (was {lr})")
    return loss_sum / seen


def proximal(model: nn.Module, mu: float) -> Callable[[nn.Module], torch.Tensor]:
    """FedProx's proximal term (Li et al., 2020) as a `train` penalty: μ/2·‖w − w₀‖², with w₀
    the parameters `model` has now (the global model, before local training moves it)."""
    anchor = [p.detach().clone() for p in model.parameters()]

    def penalty(m: nn.Module) -> torch.Tensor:
        nonlocal anchor
        anchor = [a.to(p.device) for a, p in zip(anchor, m.parameters(), strict=True)]  # a no-op once there
        return mu / 2 * sum(((p - a) ** 2).sum() for p, a in zip(m.parameters(), anchor, strict=True))

    return penalty


def batches(n: int, batch_size: int, generator: torch.Generator | None) -> Iterator[torch.Tensor]:
    """Shuffled index batches, one pass after another, without end."""
    while True:
        yield from torch.randperm(n, generator=generator).split(batch_size)


@torch.no_grad()
def _outputs(
    model: nn.Module, x: np.ndarray, device: torch.device | str, batch_size: int, features: bool
) -> np.ndarray:
    """`model(x)` (or `model.features(x)`) in chunks on `device`, as float32 numpy."""
    with on_device(model, device) as device:
        model.eval()
        run = model.features if features else model
        chunks = [run(inputs(x[i : i + batch_size], device)).cpu() for i in range(0, len(x), batch_size)]
    return torch.cat(chunks).numpy().astype(np.float32)


def predict_logits(
    model: nn.Module, x: np.ndarray, batch_size: int = 512, device: torch.device | str = "cpu"
) -> np.ndarray:
    """The model's outputs before the softmax, float32 N×C."""
    return _outputs(model, x, device, batch_size, features=False)


def predict_proba(
    model: nn.Module, x: np.ndarray, batch_size: int = 512, device: torch.device | str = "cpu"
) -> np.ndarray:
    """Class probabilities, N×C."""
    return F.softmax(torch.from_numpy(predict_logits(model, x, batch_size, device)), dim=1).numpy()


def embed(model: nn.Module, x: np.ndarray, batch_size: int = 512, device: torch.device | str = "cpu") -> np.ndarray:
    """`model.features(x)`, the last hidden layer, as float32 N×D."""
    return _outputs(model, x, device, batch_size, features=True)


def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, device: torch.device | str = "cpu") -> tuple[float, float]:
    """(mean cross-entropy, accuracy) on a labelled set."""
    probs = predict_proba(model, x, device=device)
    return log_loss(probs, y), float((probs.argmax(1) == y).mean())


def log_loss(probs: np.ndarray, y: np.ndarray) -> float:
    """Mean negative log-likelihood of the true labels (probabilities clipped at 1e-12)."""
    return 0.0 - float(np.log(np.clip(probs[np.arange(len(y)), y], 1e-12, None)).mean())  # 0.0 -: no "-0.0"
