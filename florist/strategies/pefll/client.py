"""PeFLL's and OD-PFL's client half (they differ only in the encoder, `networks.py`):

1. `describe`: the descriptor v under the received encoder η_v: PeFLL's mean φ(x, y) over a
   seeded batch of the train split (the whole split when predicting), or OD-PFL's set encoding
   of the whole train split's x, never its labels;
2. `train`: k SGD steps (OD-PFL with `odpfl-local-epochs`: E epochs) from θ = h(v) on
   L(θ) + λ_θ‖θ‖²; reply Δθ;
3. `backprop`: Δη_v = (∂v/∂η_v)ᵀ Δv, on the same samples as in 1.

η_v is remembered for the run between messages 1 and 3, so it travels down once per round.
`evaluate` receives θ = h(v), keeps it in the node's folder (a served node's deliverable: its
own code loads it from there) and tests it when the node has labels.

A node being served under OD-PFL with a finite `dp-epsilon` adds Gaussian noise to its
descriptor before sending it: the server never sees the clean one. The descriptor is a mean of
|D| unit vectors, so replacing one sample moves it by at most Δg = 2/|D| in L2; adding
ξ ~ N(0, σ²I) makes what the node sends (ε, δ)-differentially private with respect to any one
of its samples (OD-PFL, Section 7) when σ is calibrated for (ε, δ, Δg). For ε < 1 that is the
classic σ² = 2·Δg²·log(1.25/δ)/ε², whose proof holds for ε < 1 only (at ε = 10, δ = 1e-5
it falls short); from ε = 1 on it is the analytic Gaussian mechanism's σ (Balle & Wang,
ICML 2018), the least σ meeting the mechanism's exact (ε, δ) condition. The reply says which.
"""

from __future__ import annotations

import math
import sys
import zlib

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict

from florist.client import personal
from florist.client.node import Node, Request
from florist.common import protocol, training
from florist.strategies.pefll.networks import EmbeddingNet, Encoder, SetEncoder, class_statistics
from florist.strategies.pefll.spec import DESCRIPTOR, OnDemandSettings

ENCODER = "encoder"  # η_v from message 1, remembered for the run
ANALYTIC_FROM = 1.0  # from this ε on, σ is calibrated analytically (the classic proof needs ε < 1)


def _encoder(node: Node, request: Request, noised: bool = False) -> Encoder:
    """The server's encoder (`PeFLL.new_encoder`, `ODPFL.new_encoder`), chosen by the node's
    own run config: no server can make an OD-PFL node describe itself by its labels, and a node
    that noises its descriptor puts φ on the unit sphere whatever the request says."""
    settings, shape, classes = node.cfg.settings, node.data.input_shape, node.cfg.num_classes
    if isinstance(settings, OnDemandSettings):
        normalize = request.settings.normalize or noised
        return SetEncoder(shape, classes, request.settings.embed_dim, normalize=normalize, psi=settings.psi)
    return EmbeddingNet(shape, classes, request.settings.embed_dim, kind=settings.encoder)


def _samples(node: Node, encoder: Encoder, whole: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the descriptor averages over. OD-PFL: the train split's x, never a label. PeFLL:
    (x, y) pairs of a batch drawn from (seed, round, node), so that messages 1 and 3 of a round
    see the same one, or of the whole train split."""
    d = node.data
    if not encoder.uses_labels:
        return training.inputs(d.x_train), None
    if not d.labelled:
        raise ValueError(f"node {node.key}: PeFLL describes a client by (x, y), but the node's data has no labels")
    index = np.arange(len(d.x_train))
    if not whole:
        rng = np.random.default_rng([node.cfg.seed, node.server_round, zlib.crc32(node.key.encode())])
        index = np.sort(rng.choice(index, min(node.cfg.settings.batch, len(index)), replace=False))
    return training.inputs(d.x_train[index]), torch.from_numpy(d.y_train[index])


def describe(node: Node, request: Request) -> RecordDict:
    """Message 1 (and the first of predict): the descriptor under the received encoder. A
    served OD-PFL node with a finite ε noises the mean of φ, before ψ (post-processing)."""
    settings = node.cfg.settings
    private = request.settings.serve and isinstance(settings, OnDemandSettings)
    noised = private and math.isfinite(settings.dp_epsilon)
    encoder = _encoder(node, request, noised)
    reference = encoder.state_dict()
    encoder.load_state_dict(protocol.arrays_of(request.content, reference, f"node {node.key}: the server's message"))
    x, y = _samples(node, encoder, whole=request.settings.predict)
    metrics = {"num-examples": len(x)}
    with torch.no_grad():
        pooled = encoder.pool(x, y, chunk=settings.encode_batch)
        if private:
            epsilon, delta = settings.dp_epsilon, settings.dp_delta
            sigma = gaussian_sigma(epsilon, delta, len(x))
            pooled = privatize(pooled, sigma) if sigma > 0 else pooled
            dp = {"dp-epsilon": epsilon, "dp-delta": delta, "dp-analytic": int(is_analytic(epsilon))}
            metrics |= {"dp-sigma": sigma} | (dp if noised else {})
        v = encoder.readout(pooled)
    if not request.settings.predict:
        node.state.remember(ENCODER, encoder.state_dict(), server_round=node.server_round)
    side = None
    if settings.reads_class_means:  # over the whole train split, whatever batch v was drawn from
        if not request.settings.predict:  # (predicting, v was drawn from it already)
            x, y = _samples(node, encoder, whole=True)
        side = ArrayRecord(class_statistics(x, y, node.cfg.num_classes))
    return protocol.content(ArrayRecord({DESCRIPTOR: v}), metrics=metrics, side=side)


def train(node: Node, request: Request) -> RecordDict:
    """Message 2: local SGD from θ on L(θ) + λ_θ‖θ‖² (weight decay 2λ_θ), k steps or OD-PFL's
    E epochs (`schedule`); reply Δθ."""
    model = node.received_model(request)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    settings = node.cfg.settings
    epochs, steps = settings.schedule
    loss = node.fit(model, epochs, steps=steps, weight_decay=2 * settings.l2_model)
    delta = {k: v - start[k] for k, v in model.state_dict().items()}
    return protocol.content(ArrayRecord(delta), metrics={"num-examples": len(node.data.x_train), "train-loss": loss})


def backprop(node: Node, request: Request) -> RecordDict:
    """Message 3: Δv backpropagated through the encoder on message 1's samples; reply Δη_v."""
    kept = node.state.recall(ENCODER)
    held = kept[1].get("server_round") if kept else None
    if held != node.server_round:
        raise protocol.ProtocolError(
            f"node {node.key}: no encoder from message 1 of round {node.server_round} (this node holds round {held})"
        )
    encoder = _encoder(node, request)
    encoder.load_state_dict(kept[0])
    x, y = _samples(node, encoder, whole=False)
    v = encoder.describe(x, y, chunk=node.cfg.settings.encode_batch)
    source = f"node {node.key}: the server's message"
    dv = protocol.arrays_of(request.content, {DESCRIPTOR: v.detach()}, source)[DESCRIPTOR]
    names, params = zip(*encoder.named_parameters())
    grads = torch.autograd.grad(v, params, grad_outputs=dv)
    return protocol.content(ArrayRecord(dict(zip(names, grads))), metrics={"num-examples": len(x)})


def evaluate(node: Node, request: Request) -> RecordDict:
    """Predict's last step: keep θ = h(v) as the model this node earned (`client/personal.py`,
    where `florist predict` finds it) and score it when the node has test labels."""
    model = node.received_model(request)
    if node.data.y_test is None:  # an unlabeled node: it gets its model, nobody can score it
        personal.keep(node, model, None)
        return protocol.content(
            metrics={"num-examples": 0, "num-train": len(node.data.x_train), "seen": int(node.seen)}
        )
    return node.test_reply(model)


def gaussian_sigma(epsilon: float, delta: float, num_samples: int) -> float:
    """σ of the Gaussian mechanism for a mean of `num_samples` unit vectors (0 for ε = inf):
    the classic calibration where its proof holds (ε < 1), the analytic one from ε = 1 on."""
    if not epsilon > 0:
        raise ValueError(f"dp-epsilon must be > 0 (inf: no noise), got {epsilon}")
    if not 0 < delta < 1:
        raise ValueError(f"dp-delta must be in (0, 1), got {delta}")
    if num_samples < 1:
        raise ValueError("differential privacy needs at least one sample in the descriptor, got |D| = 0")
    if math.isinf(epsilon):
        return 0.0
    calibrate = analytic_sigma if is_analytic(epsilon) else classic_sigma
    return calibrate(epsilon, delta, 2.0 / num_samples)


def is_analytic(epsilon: float) -> bool:
    """Whether `gaussian_sigma` calibrates this ε analytically (the node's row says which)."""
    return epsilon >= ANALYTIC_FROM


def classic_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """σ = Δ·√(2·log(1.25/δ))/ε, (ε, δ)-DP for ε < 1 only (Dwork & Roth 2014, Theorem A.1)."""
    return sensitivity * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def gaussian_delta(sigma: float, epsilon: float, sensitivity: float) -> float:
    """The least δ for which N(0, σ²I) noise on a query of L2 sensitivity Δ is (ε, δ)-DP, for
    any ε: Φ(Δ/2σ − εσ/Δ) − e^ε·Φ(−Δ/2σ − εσ/Δ) (Balle & Wang 2018, Theorem 8). A second term
    too small for a normal float is dropped, which can only overstate δ."""
    a, b = sensitivity / (2.0 * sigma), epsilon * sigma / sensitivity
    tail = _normal_cdf(-a - b)
    return _normal_cdf(a - b) - (math.exp(epsilon + math.log(tail)) if tail >= sys.float_info.min else 0.0)


def analytic_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """The least σ with `gaussian_delta(σ) <= δ` (the analytic Gaussian mechanism, Balle & Wang
    2018, Algorithm 1), by bisection on σ itself since δ falls as σ grows; the value returned
    is on the private side of the root, within a relative 1e-12 of it."""

    def private(sigma: float) -> bool:
        return gaussian_delta(sigma, epsilon, sensitivity) <= delta

    low, high = sensitivity, sensitivity
    while not private(high):
        high *= 2.0
    while private(low):  # δ → 1 as σ → 0, so this ends
        low /= 2.0
    while high - low > 1e-12 * high:
        middle = (low + high) / 2.0
        low, high = (low, middle) if private(middle) else (middle, high)
    return high


def _normal_cdf(x: float) -> float:
    """Φ(x), accurate in both tails (erfc, not 1 − erf)."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def privatize(descriptor: torch.Tensor, sigma: float) -> torch.Tensor:
    """`descriptor + ξ`, ξ ~ N(0, σ²I) drawn from fresh OS entropy: a seeded generator would
    let anyone who knows the run's seed subtract the noise again."""
    noise = np.random.default_rng().normal(0.0, sigma, size=tuple(descriptor.shape))
    return descriptor + torch.from_numpy(noise).to(descriptor.dtype)
