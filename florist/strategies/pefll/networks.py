"""The networks of the hypernetwork strategies. An encoder turns a client's data into a
descriptor v: PeFLL's embedding network (Scott et al., 2024) reads labelled pairs, OD-PFL's
set encoder unlabeled samples only. The hypernetwork h maps v to every parameter θ of the
client model. The server owns both; clients evaluate the encoder only."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from florist.common.models import Net


def _trunk(in_shape: tuple[int, ...]) -> tuple[nn.Module, int]:
    """Per-sample features for OD-PFL's set encoder: a small conv net for images (pooled to
    2×2, so any image size works), flattening for vectors. Returns the module and its width."""
    if len(in_shape) == 3:
        convs = nn.Sequential(
            nn.Conv2d(in_shape[0], 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
        )
        return convs, 32 * 2 * 2
    return nn.Flatten(), math.prod(in_shape)


class Encoder(nn.Module):
    """A per-sample network whose mean over a client's samples is the client's descriptor."""

    uses_labels: ClassVar[bool]

    def describe(self, x: torch.Tensor, y: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
        """The exact mean of the per-sample outputs, `chunk` samples at a time (0: all at once)."""
        step = chunk or len(x)
        parts = [self(x[i : i + step], None if y is None else y[i : i + step]) for i in range(0, len(x), step)]
        return sum(part.sum(0) for part in parts) / len(x)


class EmbeddingNet(Encoder):
    """PeFLL's φ(x, y): the sample (an image pooled to at most 8×8 per channel) placed in the
    slot of its label, i.e. its outer product with the one-hot label, then two fully connected
    layers with a ReLU between them; the descriptor is their mean over the samples (the ReLU
    comes first, so it is not a function of each label's mean sample alone). The label's slot
    tells clients apart whose labels mean different things, even before training; a conv
    trunk's features joined with the label do not, at initialization, and 30 server steps do
    not teach them to (README, PeFLL). florist's network, not the paper's."""

    uses_labels = True

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, embed_dim: int, hidden: int = 64):
        super().__init__()
        self.num_classes = num_classes
        if len(in_shape) == 3:
            side = (min(in_shape[1], 8), min(in_shape[2], 8))
            self.body, width = nn.Sequential(nn.AdaptiveAvgPool2d(side), nn.Flatten()), in_shape[0] * math.prod(side)
        else:
            self.body, width = nn.Flatten(), math.prod(in_shape)
        self.head = nn.Sequential(nn.Linear(width * num_classes, hidden), nn.ReLU(), nn.Linear(hidden, embed_dim))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        slots = self.body(x).unsqueeze(1) * F.one_hot(y, self.num_classes).to(x.dtype).unsqueeze(2)
        return self.head(slots.flatten(1))


class SetEncoder(Encoder):
    """OD-PFL's DeepSets encoder on unlabeled samples: g(D) = ψ(mean_i φ(x_i)), with φ's
    output on the unit sphere and ψ the identity. Then replacing one of the |D| samples moves
    g by at most 2/|D| in L2, the sensitivity the served node's Gaussian noise is calibrated
    to; a learned ψ after the mean would void that bound."""

    uses_labels = False

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, embed_dim: int, hidden: int = 64):
        super().__init__()
        body, width = _trunk(in_shape)
        self.phi = nn.Sequential(body, nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, embed_dim))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return F.normalize(self.phi(x), dim=1)


class HyperNetwork(nn.Module):
    """h(v): three fully connected layers; the last one outputs all of the client model's
    parameters at once. Its bias starts as a freshly initialised client model and its weight
    small, so that the first rounds start from a well-scaled θ whatever v is."""

    def __init__(self, template: Net, embed_dim: int, hidden: int = 100, init_scale: float = 0.1):
        super().__init__()
        params = dict(template.named_parameters())
        if set(params) != set(template.state_dict()):
            raise ValueError(
                f"the hypernetwork generates parameters only; model {type(template).__name__} also has buffers "
                "(e.g. BatchNorm statistics): choose cnn, lenet or mlp"
            )
        self.shapes = {name: p.shape for name, p in params.items()}
        total = sum(p.numel() for p in params.values())
        self.body = nn.Sequential(nn.Linear(embed_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.out = nn.Linear(hidden, total)
        with torch.no_grad():
            self.out.bias.copy_(torch.cat([p.detach().flatten() for p in params.values()]))
            self.out.weight.mul_(init_scale)

    def forward(self, v: torch.Tensor) -> dict[str, torch.Tensor]:
        flat = self.out(self.body(v))
        chunks = flat.split([math.prod(s) for s in self.shapes.values()])
        return {name: chunk.view(shape) for (name, shape), chunk in zip(self.shapes.items(), chunks)}


def default_embed_dim(num_train_clients: int) -> int:
    """The descriptor size l = 1 + n/4 of pFedHN's code (the PeFLL paper states l = n/4; the
    1 keeps l >= 1 for fewer than four clients)."""
    return 1 + num_train_clients // 4
