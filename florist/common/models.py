"""Client models. Each one exposes `features(x)`, its last hidden layer (the representation
kNN-Per stores and FedAttn summarises), and `forward(x) = head(features(x))`."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
from torch import nn


class Net(nn.Module):
    """A backbone (`body`, ending in the last hidden layer) and a linear `head`."""

    body: nn.Module
    head: nn.Module
    architecture: str  # its name in `build_model`

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class SmallCNN(Net):
    """Two 3×3 convolutions and one pooling: enough for 8×8 digits, fast on a CPU, up to 32×32
    (`INPUTS`; `cnn-wide` doubles the channels and the hidden layer)."""

    def __init__(self, in_shape: tuple[int, int, int], num_classes: int, width: int = 16, hidden: int = 128):
        super().__init__()
        channels, height, side = in_shape
        self.body = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * width * (height // 2) * (side // 2), hidden),
            nn.ReLU(),
        )
        self.head = nn.Linear(hidden, num_classes)


class LeNet(Net):
    """The PeFLL paper's LeNet: conv 16 5×5, pool, conv 32 5×5, pool, FC 120, FC 84, FC C."""

    def __init__(self, in_shape: tuple[int, int, int], num_classes: int):
        super().__init__()
        channels, size, _ = in_shape
        side = ((size - 4) // 2 - 4) // 2
        self.body = nn.Sequential(
            nn.Conv2d(channels, 16, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * side * side, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
        )
        self.head = nn.Linear(84, num_classes)


class MLP(Net):
    """Flattened input, two hidden layers."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, int] = (128, 64)):
        super().__init__()
        self.body = nn.Sequential(
            nn.Flatten(),
            nn.Linear(math.prod(in_shape), hidden[0]),
            nn.ReLU(),
            nn.Linear(hidden[0], hidden[1]),
            nn.ReLU(),
        )
        self.head = nn.Linear(hidden[1], num_classes)


class MobileNetV2(Net):
    """torchvision's MobileNetV2 (random init); features = the pooled 1280-d vector. Its adaptive
    pooling makes it take any image from 32×32 (five halvings leave 1×1) with the same weights."""

    def __init__(self, in_shape: tuple[int, int, int], num_classes: int):
        super().__init__()
        from torchvision.models import mobilenet_v2

        net = mobilenet_v2(weights=None, num_classes=num_classes)
        self.body = nn.Sequential(net.features, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = net.classifier


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The per-sample input shapes a built-in model is designed for: images C×H×W (with
    `channels` channels, any when 0) whose sides lie in `sides` (no upper limit when its second
    value is 0) or are one of the square `squares`; or, with `max_values`, any shape of at most
    that many values. `build_model` refuses the rest, so a misfit stops a run at start-up."""

    channels: int = 0
    sides: tuple[int, int] = (1, 0)
    squares: tuple[int, ...] = ()
    max_values: int = 0

    def accepts(self, shape: tuple[int, ...]) -> bool:
        if self.max_values:
            return math.prod(shape) <= self.max_values
        if len(shape) != 3 or self.channels not in (0, shape[0]):
            return False
        if self.squares:
            return shape[1] == shape[2] and shape[1] in self.squares
        low, high = self.sides
        return all(low <= side <= (high or side) for side in shape[1:])

    def resized(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """The H, W nearest to an image's that this takes (what `image-size` would make of it),
        or None when resizing cannot make it fit (not an image, or other channels)."""
        if len(shape) != 3 or self.channels not in (0, shape[0]):
            return None
        height, width = shape[1:]
        if self.max_values:  # both sides scaled by one factor, down to at most max_values
            scale = math.sqrt(self.max_values / math.prod(shape))
            return (int(height * scale), int(width * scale)) if scale < 1 and shape[0] <= self.max_values else None
        if self.squares:
            side = min(self.squares, key=lambda s: (abs(s - max(height, width)), -s))
            return side, side
        low, high = self.sides
        return max(low, min(height, high or height)), max(low, min(width, high or width))

    def __str__(self) -> str:
        if self.max_values:
            return f"any shape of at most {self.max_values:,} values"
        channels = str(self.channels or "C")
        if self.squares:
            return " or ".join(f"{channels}×{side}×{side}" for side in self.squares)
        low, high = self.sides
        return f"{channels}×H×W, H and W from {low} to {high}" if high else f"{channels}×H×W, H and W {low} or more"


# What each built-in model takes (docs/models.md's table states the same, a test checks it). The
# CNNs flatten their one pooled map, so their weights grow with H×W (cnn: 0.3 MB at 8×8, 4.2 MB at
# 32×32, 16.8 MB at 64×64) while their receptive field stays 6 pixels: beyond 32×32 they grow
# without seeing more. LeNet's fully connected layers are sized for the paper's 28×28 and 32×32.
# The MLP's first layer grows with the input too: up to CIFAR's 3,072 values (1.6 MB). MobileNetV2
# pools adaptively, so its 9.1 MB of weights take any image from its 32× downsampling's 32×32 up.
INPUTS = {
    "cnn": Inputs(sides=(8, 32)),
    "cnn-wide": Inputs(sides=(8, 32)),
    "lenet": Inputs(squares=(28, 32)),
    "mlp": Inputs(max_values=3 * 32 * 32),
    "mobilenet_v2": Inputs(channels=3, sides=(32, 0)),
}
MODEL_NAMES = tuple(INPUTS)


def shape_text(shape: tuple[int, ...]) -> str:
    return "×".join(map(str, shape))


def megabytes(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:,.1f} MB"


def check_inputs(name: str, in_shape: tuple[int, ...]) -> None:
    """Raise ValueError, in one line naming what would fit, unless model `name` takes `in_shape`."""
    if name not in INPUTS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")
    if INPUTS[name].accepts(in_shape):
        return
    size = INPUTS[name].resized(in_shape)
    others = [other for other, inputs in INPUTS.items() if other != name and inputs.accepts(in_shape)]
    fixes = [f"image-size={size[0]},{size[1]} (image folders)"] if size else []
    if others:
        fixes.append(f"model={others[0]}" if len(others) == 1 else f"one of model={', '.join(others)}")
    fix = f"use {' or '.join(fixes)}" if fixes else "no built-in model takes it"
    raise ValueError(f"model {name!r} takes {INPUTS[name]}; got {shape_text(in_shape)}: {fix}")


def build_model(name: str, in_shape: tuple[int, ...], num_classes: int) -> Net:
    """The model called `name` for inputs of `in_shape` (without the batch dimension); it
    carries its name as `architecture`, which a kept model's manifest records."""
    in_shape = tuple(int(d) for d in in_shape)
    check_inputs(name, in_shape)
    model = _build(name, in_shape, num_classes)
    model.architecture = name
    return model


def _build(name: str, in_shape: tuple[int, ...], num_classes: int) -> Net:
    if name in ("cnn", "cnn-wide"):
        wide = {"width": 32, "hidden": 256} if name == "cnn-wide" else {}
        return SmallCNN(in_shape, num_classes, **wide)  # type: ignore[arg-type]
    if name == "lenet":
        return LeNet(in_shape, num_classes)  # type: ignore[arg-type]
    if name == "mlp":
        return MLP(in_shape, num_classes)
    return MobileNetV2(in_shape, num_classes)  # type: ignore[arg-type]


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch's default generator seeded with `seed` inside the block and restored after it:
    networks built inside start from the same weights for a seed, wherever they are built (a
    client's model equals the server's), and nothing outside the block sees its draws. Only
    the CPU's generator, the one networks are built with: `torch.manual_seed` also seeds every
    accelerator's, and where none is initialised yet it queues each with a formatted stack,
    a third of building a LeNet on every message."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


def seeded_model(name: str, in_shape: tuple[int, ...], num_classes: int, seed: int) -> Net:
    """`build_model` with the weights `seed` gives."""
    with seeded(seed):
        return build_model(name, in_shape, num_classes)


def bias_names(model: nn.Module) -> list[str]:
    """Every bias vector of `model`, in its parameter order: FedAttn's personalized part."""
    return [name for name, _ in model.named_parameters() if name.endswith("bias")]


def flat_biases(state: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """The `names` tensors of `state` (the biases) as one detached vector, in that order."""
    return torch.cat([state[name].flatten() for name in names]).detach()
