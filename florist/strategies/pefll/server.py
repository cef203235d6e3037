"""PeFLL's and OD-PFL's server half: the hypernetwork h and the encoder η_v, updated from the
three exchanges of a round by the chain rule; PeFLL-predict for clients that never trained.
A robust `aggregation` combines the clients' Δη in place of their mean (`robust_gradients`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord

from florist.common.devices import moved
from florist.common.models import build_model, seeded
from florist.server.aggregation import Aggregator, Outcome
from florist.server.report import pct
from florist.server.strategy import TESTED, TRAINED, NodeInfo, Reply, ServerStrategy, mean_loss
from florist.strategies.pefll.networks import (
    ClassMeans,
    EmbeddingNet,
    Encoder,
    HyperNetwork,
    SetEncoder,
    Standardizer,
    class_mean_width,
    default_embed_dim,
)
from florist.strategies.pefll.spec import (
    COUNTS,
    DESCRIBE,
    DESCRIPTOR,
    EVALUATE_GENERATED,
    MEANS,
    TRAIN_ENCODER,
    TRAIN_GENERATED,
    VARIANCE,
    HyperNetSettings,
    OnDemandSettings,
)

Params = dict[str, torch.Tensor]
# A child of Flower's logger, so the warning reaches `flwr run --stream` and the SuperLink log.
log = logging.getLogger("flwr").getChild(__name__)


class PeFLL(ServerStrategy):
    settings: HyperNetSettings
    normalized = False  # OD-PFL's flag for its set encoder (PeFLL's network has no such choice)
    checkpointed = ("hyper", "embed", "optimizer", "standardizer", "class_means")
    SEPARATED = 1e-3  # below this share of between-node variance, descriptors do not separate nodes
    WATCH_ROUND = 5  # the round (or the run's last, if sooner) whose descriptors are judged
    HINT = (
        "if clients differ in how labels relate to inputs (concept shift), try "
        'hn-encoder="slots" hn-standardize-components=true hn-grad-clip=50'
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg, hn = self.cfg, self.settings
        self.embed_dim = hn.embed_dim or default_embed_dim(self.num_seen)
        width = class_mean_width(self.input_shape) if hn.reads_class_means else 0
        self.class_means = ClassMeans(cfg.num_classes, width).to(self.device)
        with seeded(cfg.seed):  # the three networks start alike for a seed
            template = build_model(cfg.model, self.input_shape, cfg.num_classes)
            self.hyper = HyperNetwork(template, self.embed_dim, hn.hidden, side=self.class_means.width)
            self.embed: Encoder = self.new_encoder()
        self.hyper.to(self.device), self.embed.to(self.device)  # built on the CPU: the same start on any device
        self.standardizer = Standardizer(hn.standardize, hn.standardize_components).to(self.device)
        self.template = template.state_dict()
        self.aggregator = Aggregator.of(cfg)  # over the clients' Δη when the run names a robust rule
        self.optimizer = server_optimizer(hn, self.hyper, self.embed)
        self.extras: dict[str, Any] = {}  # the last round's robust-rule fields (`round_extras`)

    def new_encoder(self) -> Encoder:
        """PeFLL's embedding network of kind `hn-encoder`."""
        return EmbeddingNet(self.input_shape, self.cfg.num_classes, self.embed_dim, kind=self.settings.encoder)

    def load_state(self, state: dict[str, Any]) -> None:
        """As the base's; a checkpoint from before `hn-standardize` (`hn-class-means`) existed has
        no standardizer (class means)."""
        fresh = {"standardizer": self.standardizer.state_dict(), "class_means": self.class_means.state_dict()}
        super().load_state(fresh | state)

    def describe(
        self, server_round: int, nodes: list[NodeInfo], predict: bool = False, serve: bool = False
    ) -> dict[int, Reply]:
        """η_v down, each node's descriptor v up (over its whole train split with `predict`)."""
        encoder = ArrayRecord(moved(self.embed.state_dict(), "cpu"))
        flags = {"embed_dim": self.embed_dim, "predict": predict, "serve": serve, "normalize": self.normalized}
        request = self.request(DESCRIBE, server_round, encoder, **flags)
        reference = {DESCRIPTOR: torch.zeros(self.embed_dim)}
        side = None
        if self.class_means.width:
            classes, width = self.class_means.center.shape
            side = {MEANS: torch.zeros(classes, width), COUNTS: torch.zeros(classes), VARIANCE: torch.zeros(width)}
        return self.broadcast(DESCRIBE, nodes, server_round, request, ("num-examples",), reference, side)

    def train_round(self, server_round: int, nodes: list[NodeInfo]) -> float | None:
        described = self.describe(server_round, nodes)
        v = {node: r.arrays[DESCRIPTOR].to(self.device).clone().requires_grad_() for node, r in described.items()}
        read = self.inputs(described, v, training=True)
        theta = {node: self.hyper(*x) for node, x in read.items()}
        requests = {
            node: self.request(TRAIN_GENERATED, server_round, ArrayRecord(moved(t, "cpu"))) for node, t in theta.items()
        }
        trained = self.ask(TRAIN_GENERATED, requests, server_round, TRAINED, self.template)
        delta = {node: moved(r.arrays, self.device) for node, r in trained.items()}
        # Δv_i = (∂θ_i/∂v_i)ᵀ Δθ_i, a vector-Jacobian product through h.
        dv = {
            node: torch.autograd.grad(_inner(theta[node], d), v[node], retain_graph=True)[0]
            for node, d in delta.items()
        }
        requests = {
            node: self.request(
                TRAIN_ENCODER,
                server_round,
                ArrayRecord({DESCRIPTOR: g.cpu()}),
                embed_dim=self.embed_dim,
                normalize=self.normalized,
            )
            for node, g in dv.items()
        }
        embedded = self.ask(
            TRAIN_ENCODER, requests, server_round, ("num-examples",), moved(self.embed.state_dict(), "cpu")
        )
        # Only clients that completed all three exchanges count; fixed order: same seed, same sums.
        done = [n for n in nodes if n.node_id in embedded]
        described_by = [v[n].detach() if f is None else torch.cat([v[n].detach(), f]) for n, (_, f) in read.items()]
        self.extras = {"descriptor_between": between_share(described_by)}
        if self.class_means.width:
            self.extras["class_means_weight"] = float(self.class_means.weight)
        self.watch(server_round, self.extras["descriptor_between"])
        if done:
            ids = [n.node_id for n in done]
            outcome = self.update({i: (theta[i], delta[i], moved(embedded[i].arrays, self.device)) for i in ids})
            self.extras |= {} if outcome is None else outcome.row([n.key for n in done])
        return mean_loss(trained[n.node_id].metrics for n in done)

    def watch(self, server_round: int, share: float) -> None:
        """One warning line when, at `WATCH_ROUND`, the nodes' descriptors hardly differ: h then
        gives every node nearly the same model, and a run under concept shift (label mixes alike,
        labels meaning different things) stays near FedAvg's accuracy without a word."""
        if server_round == min(self.WATCH_ROUND, self.cfg.num_server_rounds) and share < self.SEPARATED:
            log.warning(
                "%s's descriptors hardly differ between nodes (%.2g of their variance, round %d): every "
                "node gets nearly the same model; %s",
                self.cfg.strategy,
                share,
                server_round,
                self.hint,
            )

    @property
    def hint(self) -> str:
        """What to try when the descriptors do not separate, given what the run already set."""
        if not self.settings.reads_class_means:
            return "if clients differ in how labels relate to inputs (concept shift), set hn-class-means=true"
        if self.settings.encoder != "slots":
            return self.HINT
        if not self.settings.standardize_components:
            return "slots alone may need about 60 rounds: add hn-standardize-components=true hn-grad-clip=50"
        return "they may separate in a later round"

    def inputs(self, described: dict[int, Reply], v: dict[int, torch.Tensor], training: bool = False):
        """What h reads of each node, (descriptor, class means): its descriptor as `standardized`
        and, with `hn-class-means`, its class means as `ClassMeans` reads them (else None),
        fitted on each training round's nodes and kept for the nodes evaluated or served after."""
        x = self.standardized(v, training)
        if not self.class_means.width:
            return {n: (x[n], None) for n in v}
        stats = {n: moved(described[n].side, self.device) for n in v}
        if training and v:
            self.class_means.fit(*(torch.stack([stats[n][k] for n in v]) for k in (MEANS, COUNTS, VARIANCE)))
        return {n: (x[n], self.class_means(stats[n][MEANS], stats[n][COUNTS])) for n in v}

    def standardized(self, v: dict[int, torch.Tensor], training: bool = False) -> dict[int, torch.Tensor]:
        """Each node's descriptor as h reads it (`hn-standardize`: (v − m)/s), m and s fitted
        on all of the first descriptors the run uses at once, so no node's place counts; per
        component (`hn-standardize-components`), on each training round's nodes, as the encoder
        moves them, and kept for the nodes evaluated or served after."""
        refit = training and self.standardizer.per_component
        if self.standardizer.active and (refit or not self.standardizer.fitted) and v:
            self.standardizer.fit(torch.stack([x.detach() for x in v.values()]))
        return {node: self.standardizer(x) for node, x in v.items()}

    def update(self, steps: dict[int, tuple[Params, Params, Params]]) -> Outcome | None:
        """One optimizer step on −mean Δη from (θ_i, Δθ_i, Δη_v,i) per client. Δη_h,i = J_iᵀΔθ_i
        comes from one backward pass through Σ_i ⟨θ_i, Δθ_i⟩; under a robust `aggregation` (or
        `clip-norm`), from one pass per client, and the rule replaces the mean (its outcome is
        returned, None under the plain mean; a rule that kept nobody takes no step). With
        `hn-grad-clip`, the combined direction of both networks is clipped to that norm first."""
        self.optimizer.zero_grad()
        outcome = None
        if not self.aggregator.plain:
            outcome = self.robust_gradients(steps)
            if not outcome.kept:  # the rule left the networks as they are: no step (Adam's would move them)
                return outcome
        else:
            (-sum(_inner(theta, delta) for theta, delta, _ in steps.values()) / len(steps)).backward()
            for name, param in self.embed.named_parameters():
                param.grad = -sum(d[name] for _, _, d in steps.values()) / len(steps)
        if self.settings.grad_clip > 0:  # over both networks at once, as the authors' script
            params = [*self.hyper.parameters(), *self.embed.parameters()]
            torch.nn.utils.clip_grad_norm_(params, self.settings.grad_clip)
        self.optimizer.step()
        return outcome

    def robust_gradients(self, steps: dict[int, tuple[Params, Params, Params]]) -> Outcome:
        """Set the networks' gradients to the run's rule over the clients' pseudo-gradients
        g_i = −(Δη_h,i, Δη_v,i), each clipped to ‖g_i‖ ≤ `clip-norm` first. The g_i live in one
        space (η), so the median, trimmed mean and Krum apply as to SGD gradients (Blanchard et
        al. and Yin et al. state them for gradients); all clients weigh alike, as in the mean.
        A g_i of zero is what a node that trained nothing sends: the rule treats it as a no-op."""
        hyper = dict(self.hyper.named_parameters())
        gradients = []
        for theta, delta, d_embed in steps.values():
            g_hyper = torch.autograd.grad(-_inner(theta, delta), list(hyper.values()), materialize_grads=True)
            gradients.append(
                {f"hyper.{k}": g.cpu() for k, g in zip(hyper, g_hyper)}
                | {f"embed.{k}": -d_embed[k].cpu() for k, _ in self.embed.named_parameters()}
            )
        zero = {k: torch.zeros_like(g) for k, g in gradients[0].items()}  # g_i = 0: a no-op reply
        outcome = self.aggregator(gradients, [1.0] * len(gradients), zero)
        for prefix, net in (("hyper", self.hyper), ("embed", self.embed)):
            for name, param in net.named_parameters():
                param.grad = outcome.state[f"{prefix}.{name}"].to(param.device)
        return outcome

    def round_extras(self) -> dict[str, Any]:
        """The share of the descriptors' variance between nodes (`between_share`) and, under a
        robust rule (`Outcome.row`), the rule that ran, why, and the nodes it left out or clipped."""
        return self.extras

    def evaluate(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        return self.predict(server_round, nodes, serve=False)

    def serve(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        return self.predict(server_round, nodes, serve=True)

    def predict(self, server_round: int, nodes: list[NodeInfo], serve: bool) -> dict[int, dict[str, float]]:
        """η_v down, v up, θ = h(v) down, test metrics up (PeFLL-predict). Nodes being served
        may hold no labels (OD-PFL): they keep their model and report no accuracy. Each row
        carries the descriptor's sample count and, when noised, its privacy settings."""
        described = self.describe(server_round, nodes, predict=True, serve=serve)
        with torch.no_grad():
            v = self.inputs(described, {node: r.arrays[DESCRIPTOR].to(self.device) for node, r in described.items()})
            theta = {node: moved(self.hyper(*x), "cpu") for node, x in v.items()}
        requests = {node: self.request(EVALUATE_GENERATED, server_round, ArrayRecord(t)) for node, t in theta.items()}
        scored = self.ask(EVALUATE_GENERATED, requests, server_round, ("num-examples",) if serve else TESTED)
        return {node: reply.metrics | _descriptor_fields(described[node].metrics) for node, reply in scored.items()}


def between_share(descriptors) -> float:
    """The share of the descriptors' mean square that lies between nodes, Σ_i‖v_i − v̄‖² /
    Σ_i‖v_i‖²: near 0, h reads every node alike and gives each nearly the same model."""
    x = torch.stack([v.detach().flatten().double() for v in descriptors])
    total = float(x.square().sum())
    return float((x - x.mean(0)).square().sum()) / total if total > 0 else 0.0


def _inner(theta: Params, delta: Params) -> torch.Tensor:
    """⟨θ, Δθ⟩ summed over all tensors; its gradient is the vector-Jacobian product with Δθ."""
    return sum((theta[k] * delta[k]).sum() for k in theta)


def _descriptor_fields(metrics: dict[str, float]) -> dict[str, float]:
    """What a node said about its descriptor: how many samples, and any privacy settings."""
    return {"descriptor-size": metrics["num-examples"]} | {k: v for k, v in metrics.items() if k.startswith("dp-")}


def server_optimizer(hn: HyperNetSettings, hyper: torch.nn.Module, embed: torch.nn.Module) -> torch.optim.Optimizer:
    """The server's step on the pseudo-gradient −mean Δη (`hn-optimizer`). SGD with learning
    rate s and weight decay 2λ is η ← (1 − 2sλ)η + s·mean Δη: Algorithm 2's η ← (1 − 2βλ)η +
    mean Δη at s = 1 (the clients' Δη carry their own step size). AdamW decays alike (decoupled)
    before Adam's step; `adam` is plain Adam, as the authors' script: no weight decay at all."""
    if hn.optimizer == "adam":
        return torch.optim.Adam([*hyper.parameters(), *embed.parameters()], lr=hn.server_lr)
    groups = [
        {"params": list(hyper.parameters()), "weight_decay": 2 * hn.l2_hyper},
        {"params": list(embed.parameters()), "weight_decay": 2 * hn.l2_embed},
    ]
    return (torch.optim.SGD if hn.optimizer == "sgd" else torch.optim.AdamW)(groups, lr=hn.server_lr)


class ODPFL(PeFLL):
    """PeFLL's training on descriptors of unlabeled data."""

    settings: OnDemandSettings
    HINT = "its descriptors read no labels: under concept shift use pefll, whose class means tell them apart"

    @property
    def hint(self) -> str:
        return self.HINT  # whatever hn-encoder says: OD-PFL's set encoder is not one of PeFLL's

    @property
    def normalized(self) -> bool:
        return self.settings.normalized

    def new_encoder(self) -> Encoder:
        """The set encoder: it describes a client by its samples alone."""
        od = self.settings
        return SetEncoder(self.input_shape, self.cfg.num_classes, self.embed_dim, normalize=od.normalized, psi=od.psi)


def report(results: dict[str, Any], folder: Path) -> list[str]:
    """OD-PFL: the served nodes that noised their descriptor, with their privacy settings and
    how σ was calibrated (rows without `dp_analytic` predate the analytic one: classic)."""
    lines: list[str] = []
    private = [c for c in results["clients"] if c.get("dp_sigma")]
    if private:
        lines += [
            "",
            "Descriptors sent with Gaussian noise for (ε, δ)-differential privacy:",
            "",
            "| client | \\|D\\| | ε | δ | σ | σ calibration | accuracy (%) |",
            "|---|---:|---:|---:|---:|---|---:|",
        ]
        lines += [
            f"| {c['client']} | {c['descriptor_size']} | {c['dp_epsilon']:g} | {c['dp_delta']:g} | "
            f"{c['dp_sigma']:.4f} | {'analytic' if c.get('dp_analytic') else 'classic'} | "
            f"{pct(c['accuracy'])} |"
            for c in private
        ]
    return lines


ODPFL.report = staticmethod(report)  # its section of report.md
