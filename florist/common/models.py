"""Client models. Each one exposes `features(x)`, its last hidden layer (the representation
kNN-Per stores and FedAttn summarises), and `forward(x) = head(features(x))`."""

from __future__ import annotations

import contextlib
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
    """Two 3×3 convolutions and one pooling: enough for 8×8 digits, fast on a CPU (`cnn-wide`
    doubles the channels and the hidden layer)."""

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
    """torchvision's MobileNetV2 (random init); features = the pooled 1280-d vector."""

    def __init__(self, in_shape: tuple[int, int, int], num_classes: int):
        super().__init__()
        from torchvision.models import mobilenet_v2

        net = mobilenet_v2(weights=None, num_classes=num_classes)
        self.body = nn.Sequential(net.features, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = net.classifier


def _require(name: str, ok: bool, in_shape: tuple[int, ...], expected: str) -> None:
    if not ok:
        raise ValueError(f"model {name!r} expects inputs of shape {expected}, got {in_shape}")


def build_model(name: str, in_shape: tuple[int, ...], num_classes: int) -> Net:
    """The model called `name` for inputs of `in_shape` (without the batch dimension); it
    carries its name as `architecture`, which a kept model's manifest records."""
    model = _build(name, tuple(int(d) for d in in_shape), num_classes)
    model.architecture = name
    return model


def _build(name: str, in_shape: tuple[int, ...], num_classes: int) -> Net:
    if name in ("cnn", "cnn-wide"):
        _require(name, len(in_shape) == 3 and min(in_shape[1:]) >= 2, in_shape, "C×H×W")
        wide = {"width": 32, "hidden": 256} if name == "cnn-wide" else {}
        return SmallCNN(in_shape, num_classes, **wide)  # type: ignore[arg-type]
    if name == "lenet":
        ok = len(in_shape) == 3 and in_shape[1] == in_shape[2] and in_shape[1] in (28, 32)
        _require(name, ok, in_shape, "C×28×28 or C×32×32")
        return LeNet(in_shape, num_classes)  # type: ignore[arg-type]
    if name == "mlp":
        return MLP(in_shape, num_classes)
    if name == "mobilenet_v2":
        _require(name, len(in_shape) == 3 and in_shape[0] == 3 and in_shape[1] >= 32, in_shape, "3×H×W, H >= 32")
        return MobileNetV2(in_shape, num_classes)  # type: ignore[arg-type]
    raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")


MODEL_NAMES = ("cnn", "cnn-wide", "lenet", "mlp", "mobilenet_v2")


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch's default generator seeded with `seed` inside the block and restored after it:
    networks built inside start from the same weights for a seed, wherever they are built (a
    client's model equals the server's), and nothing outside the block sees its draws."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
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
