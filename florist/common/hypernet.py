"""PeFLL's two networks (Scott et al., 2024). The embedding network φ turns a client's
labelled data into a descriptor v = mean φ(x, y); the hypernetwork h maps v to every
parameter θ of the client model. The server owns both; clients evaluate φ only."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from florist.common.models import Net


class EmbeddingNet(nn.Module):
    """φ(x, y): a small conv net for images (an MLP for flat inputs) whose features are
    joined with the one-hot label before two fully connected layers."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, embed_dim: int, hidden: int = 64):
        super().__init__()
        self.num_classes = num_classes
        if len(in_shape) == 3:
            self.body: nn.Module = nn.Sequential(
                nn.Conv2d(in_shape[0], 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
            )  # fmt: skip
            width = 32 * 2 * 2
        else:
            self.body, width = nn.Flatten(), math.prod(in_shape)
        self.head = nn.Sequential(nn.Linear(width + num_classes, hidden), nn.ReLU(), nn.Linear(hidden, embed_dim))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.body(x), F.one_hot(y, self.num_classes).to(x.dtype)], dim=1))

    def describe(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The client descriptor v: φ averaged over the samples."""
        return self(x, y).mean(0)


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
    """The paper's descriptor size, l = 1 + n/4."""
    return 1 + num_train_clients // 4
