"""Local training and evaluation as plain functions: numpy in, numbers out, no Flower types."""

from __future__ import annotations

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
) -> float:
    """Mini-batch SGD on cross-entropy (plus `penalty(model)` at every step when given) for
    `epochs` passes, or for exactly `steps` mini-batches when given (reshuffling at each pass).
    Returns the mean loss over the last pass (or over all steps)."""
    if len(x) == 0:
        raise ValueError("cannot train on an empty set")
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    inputs, targets = torch.from_numpy(x), torch.from_numpy(y)
    loss_sum, seen = 0.0, 0
    count = steps if steps is not None else epochs * math.ceil(len(x) / batch_size)
    for batch in itertools.islice(batches(len(x), batch_size, generator), count):
        if steps is None and seen >= len(x):  # a new epoch: report the last one only
            loss_sum, seen = 0.0, 0
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs[batch]), targets[batch])
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
    return lambda m: mu / 2 * sum(((p - a) ** 2).sum() for p, a in zip(m.parameters(), anchor, strict=True))


def batches(n: int, batch_size: int, generator: torch.Generator | None) -> Iterator[torch.Tensor]:
    """Shuffled index batches, one pass after another, without end."""
    while True:
        yield from torch.randperm(n, generator=generator).split(batch_size)


@torch.no_grad()
def predict_logits(model: nn.Module, x: np.ndarray, batch_size: int = 512) -> np.ndarray:
    """The model's outputs before the softmax, float32 N×C."""
    model.eval()
    chunks = [model(torch.from_numpy(x[i : i + batch_size])) for i in range(0, len(x), batch_size)]
    return torch.cat(chunks).numpy().astype(np.float32)


def predict_proba(model: nn.Module, x: np.ndarray, batch_size: int = 512) -> np.ndarray:
    """Class probabilities, N×C."""
    return F.softmax(torch.from_numpy(predict_logits(model, x, batch_size)), dim=1).numpy()


@torch.no_grad()
def embed(model: nn.Module, x: np.ndarray, batch_size: int = 512) -> np.ndarray:
    """`model.features(x)`, the last hidden layer, as float32 N×D."""
    model.eval()
    chunks = [model.features(torch.from_numpy(x[i : i + batch_size])) for i in range(0, len(x), batch_size)]
    return torch.cat(chunks).numpy().astype(np.float32)


def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) on a labelled set."""
    probs = predict_proba(model, x)
    return log_loss(probs, y), float((probs.argmax(1) == y).mean())


def log_loss(probs: np.ndarray, y: np.ndarray) -> float:
    """Mean negative log-likelihood of the true labels (probabilities clipped at 1e-12)."""
    return 0.0 - float(np.log(np.clip(probs[np.arange(len(y)), y], 1e-12, None)).mean())  # 0.0 -: no "-0.0"
