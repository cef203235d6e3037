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


# DP-SGD (Abadi et al., 2016, "Deep learning with differential privacy"), record-level dp's local
# training (`dp = "record"`, docs/privacy.md): every step draws a Poisson sample of the train split
# (each record with probability q), clips each sample's gradient to L2 norm C, adds N(0, σ²C²) to
# the sum and divides it by the expected batch q·n = batch-size, a fixed denominator.
#
# Per-sample gradients come from the layers themselves: a forward hook keeps each Linear's and
# Conv2d's input, the gradient of the summed loss with respect to each layer's output comes from
# one backward pass, and a layer's per-sample weight gradient is then gᵢᵀaᵢ (a convolution's over its
# unfolded input). On mnist5k's LeNet (batch 16, one CPU thread) a step costs 8.9 ms of CPU against
# plain SGD's 6.3; torch.func's vmap(grad) 12.3 ms and Opacus's GradSampleModule 21.7 ms. DP-SGD's
# own step makes no Linear's (`clipped_sum`).
PER_SAMPLE_LAYERS = (nn.Linear, nn.Conv2d)


def per_sample_layers(model: nn.Module) -> list[nn.Module]:
    """The modules holding `model`'s trainable parameters, each a Linear or a Conv2d with one group
    (whose per-sample gradients `per_sample_gradients` makes); a ValueError naming any other (a
    BatchNorm mixes the samples of a batch, so no per-sample gradient exists)."""
    layers = []
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        if not isinstance(module, PER_SAMPLE_LAYERS) or getattr(module, "groups", 1) != 1:
            raise ValueError(
                "record-level dp needs per-sample gradients, which florist makes for Linear and Conv2d layers only: "
                f"{name or 'the model'} is a {type(module).__name__} (models cnn, cnn-wide, lenet and mlp have none)"
            )
        layers.append(module)
    return layers


def per_sample_gradients(
    model: nn.Module, layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor
) -> tuple[dict[nn.Parameter, torch.Tensor], torch.Tensor]:
    """({parameter: B×numel, each row one sample's gradient of its cross-entropy}, the B losses)."""
    signals, losses = _layer_signals(model, layers, x, y)
    out = {}
    for layer, a, g in signals:
        weight, bias = _rows(layer, a, g)
        out[layer.weight] = weight
        if layer.bias is not None:
            out[layer.bias] = bias
    return out, losses


def clipped_sum(
    model: nn.Module, layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor, clip: float
) -> tuple[dict[nn.Parameter, torch.Tensor], torch.Tensor]:
    """({parameter: Σᵢ min(1, C/‖gᵢ‖)·gᵢ, shaped as it}, the B losses): DP-SGD's clipped sum, as
    `per_sample_gradients` and `clip_factors` give it, without a Linear's B per-sample weight
    gradients: a sample's gᵢaᵢᵀ has norm ‖gᵢ‖‖aᵢ‖, and the clipped sum is (f·g)ᵀa. On mnist5k's LeNet
    at batch 64 (one thread) that halves the step's per-sample work: 31 ms of CPU to 16."""
    signals, losses = _layer_signals(model, layers, x, y)
    squares, kept = torch.zeros(len(x), dtype=losses.dtype, device=losses.device), []
    for layer, a, g in signals:
        if isinstance(layer, nn.Linear) and a.dim() == 2:  # one position per sample: an outer product
            squares += g.square().sum(1) * (a.square().sum(1) + (layer.bias is not None))
            kept.append((layer, a, g, True))
        else:
            weight, bias = _rows(layer, a, g)
            squares += weight.square().sum(1) + (bias.square().sum(1) if layer.bias is not None else 0.0)
            kept.append((layer, weight, bias, False))
    factors = (clip / (torch.sqrt(squares) + 1e-12)).clamp(max=1.0)
    out = {}
    for layer, u, v, outer in kept:
        if outer:  # u the inputs, v the output gradients
            scaled = v * factors[:, None]
            out[layer.weight], bias = scaled.T @ u, scaled.sum(0)
        else:  # u the per-sample weight rows, v the bias rows
            out[layer.weight], bias = (factors @ u).view(layer.weight.shape), factors @ v
        if layer.bias is not None:
            out[layer.bias] = bias
    return out, losses


def _layer_signals(
    model: nn.Module, layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor
) -> tuple[list[tuple[nn.Module, torch.Tensor, torch.Tensor]], torch.Tensor]:
    """([(layer, its input, the gradient of the summed loss at its output)], the B losses): one
    forward pass with hooks and one backward pass to the layers' outputs."""
    inputs: dict[nn.Module, torch.Tensor] = {}
    outputs: dict[nn.Module, torch.Tensor] = {}

    def keep(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        inputs[module], outputs[module] = args[0].detach(), out

    hooks = [layer.register_forward_hook(keep) for layer in layers]
    try:
        losses = F.cross_entropy(model(x), y, reduction="none")
    finally:
        for hook in hooks:
            hook.remove()
    grads = torch.autograd.grad(losses.sum(), [outputs[layer] for layer in layers])
    return [(layer, inputs[layer], g) for layer, g in zip(layers, grads)], losses.detach()


def _rows(layer: nn.Module, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's per-sample (weight B×numel, bias B×out) gradients from its input `a` and output gradient `g`."""
    size = len(a)
    if isinstance(layer, nn.Conv2d):
        a = F.unfold(a, layer.kernel_size, layer.dilation, layer.padding, layer.stride)  # B × (C·k·k) × L
        g = g.reshape(size, g.shape[1], -1)  # B × C_out × L
        weight, bias = torch.bmm(g, a.transpose(1, 2)), g.sum(2)
    else:  # Linear, over any leading dimensions between the batch and the features
        a, g = a.reshape(size, -1, a.shape[-1]), g.reshape(size, -1, g.shape[-1])
        weight, bias = torch.bmm(g.transpose(1, 2), a), g.sum(1)
    return weight.reshape(size, -1), bias


def clip_factors(rows: list[torch.Tensor], clip: float) -> torch.Tensor:
    """min(1, C/‖gᵢ‖) for each sample i, ‖gᵢ‖ its L2 norm over all of `rows` (each B×k)."""
    squares = sum(torch.linalg.vector_norm(r, dim=1).square() for r in rows)
    return (clip / (torch.sqrt(squares) + 1e-12)).clamp(max=1.0)


def poisson_sample(n: int, rate: float, generator: torch.Generator) -> torch.Tensor:
    """The indices of a Poisson sample of n records: each in it with probability `rate`."""
    return torch.nonzero(torch.rand(n, generator=generator) < rate).flatten()


def train_private(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    steps: int,
    rate: float,
    clip: float,
    sigma: float,
    batch_size: int,
    lr: float,
    sampler: torch.Generator,
    noise: torch.Generator | None = None,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    penalty: Callable[[nn.Module], torch.Tensor] | None = None,
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
    device: torch.device | str = "cpu",
) -> float:
    """`steps` steps of DP-SGD on cross-entropy: each a Poisson sample at `rate` (from `sampler`),
    per-sample gradients clipped to `clip`, N(0, (σ·clip)²) per coordinate (from `noise`, a generator
    on `device`), the sum over the expected batch `batch_size`; then `penalty(model)`'s gradient (a term
    that reads no record: FedProx's, PerFed-CKT's distillation on P), weight decay and momentum, which
    are post-processing. Returns the mean per-sample loss over the steps (it stays on the node)."""
    if len(x) == 0:
        raise ValueError("cannot train on an empty set")
    layers = per_sample_layers(model)
    loss_sum, seen = 0.0, 0
    with on_device(model, device) as device:
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
        targets = torch.from_numpy(np.array(y)).to(device)  # a copy: memory-mapped labels are read-only
        params = [p for p in model.parameters() if p.requires_grad]
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            batch = poisson_sample(len(x), rate, sampler)
            summed = {p: torch.zeros_like(p) for p in params}
            if len(batch):
                samples = inputs(x[batch.numpy()], device)
                summed, losses = clipped_sum(
                    model, layers, augment(samples) if augment else samples, targets[batch.to(device)], clip
                )
                loss_sum, seen = loss_sum + float(losses.sum()), seen + len(batch)
            for p in params:
                drawn = _normal(p.shape, noise, device) if sigma > 0 else 0.0
                p.grad = (summed[p] + drawn * (sigma * clip)) / batch_size
            if penalty is not None:
                penalty(model).backward()  # adds its gradient to the noised one
            optimizer.step()
    if not np.isfinite(loss_sum) or not all(torch.isfinite(p).all() for p in params):
        raise FloatingPointError(f"training diverged (loss {loss_sum}); lower lr (was {lr})")
    return loss_sum / max(1, seen)


def private_mean(
    vectors: Callable[[torch.Tensor], torch.Tensor],
    n: int,
    *,
    rate: float,
    clip: float,
    sigma: float,
    batch_size: int,
    sampler: torch.Generator,
    noise: torch.Generator | None = None,
    dim: int,
) -> torch.Tensor:
    """One more DP-SGD step's release of a per-record statistic: a Poisson sample of the n records at
    `rate`, `vectors(indices)` (B×dim, one row per record) each clipped to `clip`, summed, N(0, (σ·clip)²)
    per coordinate added, over the expected batch `batch_size`: an estimate of the clipped rows' mean over
    all n records, which costs what one step costs (FedAttn's representation and bias gradient)."""
    batch = poisson_sample(n, rate, sampler)
    total = torch.zeros(dim, dtype=torch.float64)
    if len(batch):
        rows = vectors(batch).detach().double().cpu()
        total = clip_factors([rows], clip) @ rows
    drawn = _normal((dim,), noise, "cpu").double() if sigma > 0 else 0.0
    return ((total + drawn * (sigma * clip)) / batch_size).float()


def _normal(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device | str) -> torch.Tensor:
    """N(0, 1) draws of `shape` on `device`, from `generator` (on its own device) when given."""
    where = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=where).to(device)


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
