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
from florist.strategies.pefll.spec import COUNTS, ENCODERS, MEANS, VARIANCE


def _trunk(in_shape: tuple[int, ...]) -> tuple[nn.Module, int]:
    """Per-sample features (OD-PFL's set encoder, PeFLL's `trunk` and `label-channels`): a small
    conv net for images (pooled to 2×2, so any image size works), flattening for vectors.
    Returns the module and its width."""
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


def _lenet_trunk(in_shape: tuple[int, int, int]) -> tuple[nn.Module, int]:
    """The convolutions and first fully connected layer of the authors' CNNEmbed (PeFLL's
    models.py, the LeNet of their target model): conv 16 5×5, ReLU, pool 2, conv 32 5×5, ReLU,
    pool 2, FC 120, ReLU. Images under 16 pixels a side (the 8×8 digits) would have nothing
    left after two unpadded 5×5 convolutions: there each pads by 2 (8×8 → 2×2 maps), florist's."""
    pad = 0 if min(in_shape[1:]) >= 16 else 2
    convs = nn.Sequential(
        nn.Conv2d(in_shape[0], 16, 5, padding=pad),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=pad),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    with torch.no_grad():
        width = convs(torch.zeros(1, *in_shape)).shape[1]
    return nn.Sequential(convs, nn.Linear(width, 120), nn.ReLU()), 120


def _mlp(width: int, hidden: tuple[int, ...], out: int) -> nn.Sequential:
    """Fully connected layers of the given hidden widths with a ReLU after each but the last."""
    sizes = (width, *hidden)
    layers = [m for a, b in zip(sizes, sizes[1:]) for m in (nn.Linear(a, b), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(sizes[-1], out))


class Encoder(nn.Module):
    """A per-sample network whose mean over a client's samples, read out by ψ (`readout`, the
    identity unless a subclass says otherwise), is the client's descriptor."""

    uses_labels: ClassVar[bool]

    def pool(self, x: torch.Tensor, y: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
        """The exact mean of the per-sample outputs, `chunk` samples at a time (0: all at once)."""
        step = chunk or len(x)
        parts = [self(x[i : i + step], None if y is None else y[i : i + step]) for i in range(0, len(x), step)]
        return sum(part.sum(0) for part in parts) / len(x)

    def readout(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled

    def describe(self, x: torch.Tensor, y: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
        """The descriptor ψ(mean φ)."""
        return self.readout(self.pool(x, y, chunk))


class EmbeddingNet(Encoder):
    """PeFLL's φ(x, y), one of four networks (`hn-encoder`); the descriptor is the mean of φ
    over the samples.

    - `label-channels` (default): the one-hot label as constant image channels beside x, then
      OD-PFL's conv trunk, as the authors' CNNEmbed (`--embed-y`); vectors: x joined with the
      one-hot label. Clients that never trained get models as good as the seen ones' on label
      skew, the paper's claim (README, PeFLL, for the figures).
    - `trunk`: the conv trunk on x, its features joined with the one-hot label (florist's
      network up to a5c703d); on label skew as `label-channels`.
    - `slots`: x pooled to at most 8×8 per channel, placed in the slot of its label (the outer
      product with the one-hot label). It tells apart clients whose labels mean different
      things (`relabel:K`), where the others do not within tens of rounds, but clients that
      never trained fare worse on label skew (one held-out client of eight at 22 % on a
      2-class split), most of all at a large server step.
    - `paper`: the authors' CNNEmbed layer for layer (the label as image channels, then a
      LeNet: `_lenet_trunk`, FC 84, ReLU, FC l); vectors: the authors' MLP embedding (x joined
      with the one-hot label, two hidden layers of 20, their `--embed-nlayers 3 --embed-hid 20`),
      which their script defines but uses for no data set.
    The first three end in two fully connected layers (hidden width 64) with a ReLU between
    them, and are florist's networks, not the paper's. In every one a ReLU comes before the
    mean, so none is a function of each label's mean sample alone."""

    uses_labels = True
    kinds = ENCODERS

    def __init__(
        self,
        in_shape: tuple[int, ...],
        num_classes: int,
        embed_dim: int,
        hidden: int = 64,
        kind: str = "label-channels",
    ):
        super().__init__()
        if kind not in self.kinds:
            raise ValueError(f"hn-encoder must be one of {', '.join(self.kinds)}, got {kind!r}")
        self.num_classes, self.kind = num_classes, kind
        image = len(in_shape) == 3
        widths = (hidden,)
        if kind == "paper" and image:
            (self.body, width), widths = _lenet_trunk((in_shape[0] + num_classes, *in_shape[1:])), (84,)
        elif kind == "paper":
            self.body, width, widths = nn.Flatten(), math.prod(in_shape) + num_classes, (20, 20)
        elif kind == "slots" and image:
            side = (min(in_shape[1], 8), min(in_shape[2], 8))
            self.body, width = nn.Sequential(nn.AdaptiveAvgPool2d(side), nn.Flatten()), in_shape[0] * math.prod(side)
            width *= num_classes
        elif kind == "slots":
            self.body, width = nn.Flatten(), math.prod(in_shape) * num_classes
        elif kind == "label-channels" and image:
            self.body, width = _trunk((in_shape[0] + num_classes, *in_shape[1:]))
        else:  # trunk, or label-channels on vectors: the features joined with the label
            self.body, width = _trunk(in_shape)
            width += num_classes
        self.head = _mlp(width, widths, embed_dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        label = F.one_hot(y, self.num_classes).to(x.dtype)
        if self.kind == "slots":
            features = (self.body(x).unsqueeze(1) * label.unsqueeze(2)).flatten(1)
        elif self.kind in ("label-channels", "paper") and x.dim() == 4:
            planes = label[:, :, None, None].expand(-1, -1, *x.shape[2:])
            features = self.body(torch.cat([x, planes], dim=1))
        else:
            features = torch.cat([self.body(x), label], dim=1)
        return self.head(features)


class SetEncoder(Encoder):
    """OD-PFL's DeepSets encoder on unlabeled samples: g(D) = ψ(mean_i φ(x_i)). `normalize`
    puts φ's outputs on the unit sphere: then replacing one of the |D| samples moves the mean by
    at most 2/|D| in L2, the sensitivity a served node's Gaussian noise is calibrated to. The
    noise goes on the mean, before ψ, so a learned ψ (`psi="mlp"`: the paper's DS, an MLP
    after the pooling) is post-processing and keeps the guarantee. `psi="identity"`: g is the
    mean itself."""

    uses_labels = False
    readouts = ("identity", "mlp")

    def __init__(
        self,
        in_shape: tuple[int, ...],
        num_classes: int,
        embed_dim: int,
        hidden: int = 64,
        normalize: bool = True,
        psi: str = "identity",
    ):
        super().__init__()
        if psi not in self.readouts:
            raise ValueError(f"odpfl-psi must be one of {', '.join(self.readouts)}, got {psi!r}")
        body, width = _trunk(in_shape)
        self.normalize = normalize
        self.phi = nn.Sequential(body, nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, embed_dim))
        if psi == "mlp":
            self.psi = nn.Sequential(nn.Linear(embed_dim, hidden), nn.ReLU(), nn.Linear(hidden, embed_dim))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        out = self.phi(x)
        return F.normalize(out, dim=1) if self.normalize else out

    def readout(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.psi(pooled) if hasattr(self, "psi") else pooled


class HyperNetwork(nn.Module):
    """h(v): three fully connected layers; the last one outputs all of the client model's
    parameters at once. Its bias starts as a freshly initialised client model and its weight
    small, so that the first rounds start from a well-scaled θ whatever v is. With `side`
    inputs (`ClassMeans`), their own weights join the first layer's: a side of zeros leaves
    every output as it is without them, bit for bit, and those weights are drawn without
    moving the random stream, so the rest starts as it does without them."""

    def __init__(self, template: Net, embed_dim: int, hidden: int = 100, init_scale: float = 0.1, side: int = 0):
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
        if side:
            with torch.random.fork_rng(devices=[]):
                self.side = nn.Linear(side, hidden, bias=False)

    def forward(self, v: torch.Tensor, side: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        first = self.body[0](v)
        if side is not None:
            first = first + self.side(side)
        flat = self.out(self.body[1:](first))
        chunks = flat.split([math.prod(s) for s in self.shapes.values()])
        return {name: chunk.view(shape) for (name, shape), chunk in zip(self.shapes.items(), chunks)}


class Standardizer(nn.Module):
    """The authors' descriptor standardization (PeFLL's train.py), robust to any one node: h
    reads every descriptor, seen or new, as (v − m)/s with m and s fixed for the run. The
    authors take m and s, the mean and (unbiased) standard deviation over the components of
    the first descriptor the server uses, so whoever comes first chooses them (one node sending
    [1e-10, 0, …] made s tiny and every honest node's θ diverge). `fit` takes each node's m_i
    and s_i as the authors do, then their medians over round 1's nodes (the mean of the two
    middle values for an even count): no node's place in the order matters, and one node of
    three or more cannot move m or s outside the honest nodes' values (of two: s stays above
    half the honest one's). s is floored at `FLOOR` times the nodes' median root mean square,
    so that h never reads a descriptor magnified far beyond its own size (s = 1 when that is 0,
    or when a descriptor has one component). Gradients flow through it, so Δv reaches the
    encoder scaled by 1/s. Off, it is the identity."""

    FLOOR = 0.01
    COMPONENT_FLOOR = 0.1  # per component: at most ~10× (at 0.01, no clip, 4 of 8 relabel:3 seeds reached 70 %)

    def __init__(self, active: bool, per_component: bool = False):
        super().__init__()
        self.active, self.per_component = active or per_component, per_component
        self.register_buffer("shift", torch.zeros(()))
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("fitted", torch.zeros((), dtype=torch.bool))

    def fit(self, descriptors: torch.Tensor) -> None:
        """Fix m and s from `descriptors`, one row per node, in any order."""
        with torch.no_grad():
            v = descriptors.detach().double().reshape(len(descriptors), -1)
            v = v[torch.isfinite(v).all(1)]  # (replies with non-finite values are refused before)
            if self.per_component and len(v):
                return self._fit_components(v)
            shift, scale = float(_median(v.mean(1))) if len(v) else 0.0, 1.0
            if len(v) and v.shape[1] > 1:
                spread = max(float(_median(v.std(1))), self.FLOOR * float(_median(v.square().mean(1).sqrt())))
                scale = spread if spread > 1e-12 else 1.0
            self.shift.fill_(shift)
            self.scale.fill_(scale)
            self.fitted.fill_(True)

    def _fit_components(self, v: torch.Tensor) -> None:
        """`hn-standardize-components`: m and s per component, its median over the nodes and
        its median absolute deviation (× 1.4826, a normal's σ), s at least `COMPONENT_FLOOR`
        times the nodes' median root mean square. h then reads what differs between nodes at
        unit scale, where the descriptors' shared part held all but 0.2-5 % of their variance
        (relabel:3, slots) and h gave every node nearly the same model for tens of rounds.
        Medians: no node's place counts, and one node of three or more cannot move m or s
        outside the honest nodes' values, component by component."""
        shift = _median(v)
        floor = self.COMPONENT_FLOOR * float(_median(v.square().mean(1).sqrt()))
        scale = (_median((v - shift).abs()) * 1.4826).clamp_min(floor if floor > 1e-12 else 1.0)
        self.shift, self.scale = shift.to(self.shift), scale.to(self.scale)
        self.fitted.fill_(True)

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        """m and s as saved: one number each, or one per component."""
        for name in ("shift", "scale"):
            if prefix + name in state_dict:
                setattr(self, name, torch.empty_like(state_dict[prefix + name], device=getattr(self, name).device))
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return v
        if not self.fitted:
            raise RuntimeError("descriptor standardizer used before fit(): fit it on round 1's descriptors")
        return (v - self.shift) / self.scale


CLASS_MEAN_SIDE = 4  # `hn-class-means`: x pooled to at most 4×4 per channel before the per-class mean


def class_mean_width(in_shape: tuple[int, ...]) -> int:
    """How many numbers `class_statistics` keeps per class for inputs of `in_shape`."""
    if len(in_shape) == 3:
        return in_shape[0] * min(in_shape[1], CLASS_MEAN_SIDE) * min(in_shape[2], CLASS_MEAN_SIDE)
    return math.prod(in_shape)


def class_statistics(x: torch.Tensor, y: torch.Tensor, num_classes: int) -> dict[str, torch.Tensor]:
    """A node's class-conditional means of its (pooled) inputs, its label counts and the
    within-class variance of each input component, pooled over its classes: what
    `ClassMeans` needs to tell clients whose labels mean different things apart."""
    if x.dim() == 4:
        side = (min(x.shape[2], CLASS_MEAN_SIDE), min(x.shape[3], CLASS_MEAN_SIDE))
        x = F.adaptive_avg_pool2d(x, side)
    x = x.flatten(1).double()
    counts = torch.bincount(y, minlength=num_classes).double()
    means = torch.zeros(num_classes, x.shape[1], dtype=x.dtype).index_add_(0, y, x) / counts.clamp_min(1)[:, None]
    dof = len(x) - int((counts > 0).sum())
    variance = (x - means[y]).square().sum(0) / max(dof, 1)
    return {MEANS: means.float(), COUNTS: counts.float(), VARIANCE: variance.float()}


class ClassMeans(nn.Module):
    """`hn-class-means`: what h reads beside the descriptor, each node's class-conditional
    means as they differ from the federation's, shrunk by how much of that difference is more
    than sampling noise. Where labels mean different things at different nodes (`relabel:K`)
    a label's mean input differs between clusters from round 1, whatever the label mix, where
    the learned descriptor needs tens of rounds; where they mean the same the differences are
    noise, and the weight λ = 1 − noise/spread (a James–Stein shrinkage; over the nodes, the
    median of each one's sampling noise Σ_c σ²/n_c and of its squared distance from the
    centre) is 0 or near it, so h reads what it does without them. Medians throughout: one
    node of three or more cannot move the centre outside the honest nodes' values, and moves
    each median behind the scale and λ by one place among them at most."""

    def __init__(self, num_classes: int, width: int):
        super().__init__()
        self.width = num_classes * width
        self.register_buffer("center", torch.zeros(num_classes, width))
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("weight", torch.zeros(()))

    def deviations(self, means: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each node's class means less the centre, 0 for the classes it does not hold."""
        return torch.where(counts[..., None] > 0, means - self.center, torch.zeros(()))

    def fit(self, means: torch.Tensor, counts: torch.Tensor, variance: torch.Tensor) -> None:
        """Centre, scale and λ from one row per node (`class_statistics`' three arrays stacked)."""
        with torch.no_grad():
            means, counts, variance = means.double(), counts.double(), variance.double()
            held = counts > 0
            center = torch.zeros_like(means[0])
            for c in range(means.shape[1]):
                if held[:, c].any():
                    center[c] = _median(means[held[:, c], c])
            self.center = center.to(self.center)
            spread = self.deviations(means, counts).flatten(1).square().sum(1)
            noise = (held / counts.clamp_min(1)).sum(1) * variance.sum(1)
            middle = float(_median(spread))
            weight = 1.0 - float(_median(noise)) / middle if middle > 1e-12 else 0.0
            self.weight.fill_(min(max(weight, 0.0), 1.0))
            self.scale.fill_(math.sqrt(middle) if middle > 1e-12 else 1.0)

    def forward(self, means: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """What h reads of one node: λ·(means − centre)/scale, flattened."""
        return (self.weight * self.deviations(means, counts) / self.scale).flatten(-2).to(self.center.dtype)


def _median(x: torch.Tensor) -> torch.Tensor:
    """The median of a 1-d tensor (of a matrix: of each column), the mean of the two middle
    values for an even length (as `numpy.median`; torch's is the lower one, which two nodes
    would let the smaller choose)."""
    ordered, n = x.sort(0).values, len(x)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def default_embed_dim(num_train_clients: int) -> int:
    """The descriptor size l = 1 + n/4, n the training clients, as pFedHN's code. The PeFLL
    paper states l = n/4; the authors' script takes int(1 + N/4) over all N clients, held-out
    ones included (26 for their 100). florist counts the clients h learns from, and the 1 keeps
    l >= 1 for fewer than four; `hn-embed-dim` sets any other."""
    return 1 + num_train_clients // 4
