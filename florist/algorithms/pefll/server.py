"""PeFLL (Scott, Zakerinia, Lampert, ICLR 2024): an embedding network φ (weights η_v)
describes each client by its data; a hypernetwork h (weights η_h) maps the descriptor to the
client's model. A training round is Algorithm 2's three exchanges (`client/pefll.py`); a
client that never trained gets its model from one descriptor and one forward pass of h
(PeFLL-predict), with no training anywhere."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord

from florist.client.pefll import DESCRIPTOR
from florist.common import protocol
from florist.common.hypernet import ENCODERS, Encoder, HyperNetwork, default_embed_dim
from florist.strategies.base import TESTED, TRAINED, NodeInfo, Reply, Strategy, mean_loss

Params = dict[str, torch.Tensor]


class PeFLL(Strategy):
    name = "pefll"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        template = self.new_model()  # seeds torch, so both networks below start alike for a seed
        self.template = template.state_dict()
        self.embed_dim = cfg.hn_embed_dim or default_embed_dim(self.num_seen)
        self.hyper = HyperNetwork(template, self.embed_dim, cfg.hn_hidden)
        self.embed = self.new_encoder()
        # Both optimizers take the pseudo-gradient −mean Δη. SGD with weight decay 2λ is then
        # Algorithm 2's η ← (1 − 2βλ)η + β·mean Δη; AdamW decays the same way before Adam's step.
        groups = [{"params": list(self.hyper.parameters()), "weight_decay": 2 * cfg.hn_l2_hyper},
                  {"params": list(self.embed.parameters()), "weight_decay": 2 * cfg.hn_l2_embed}]  # fmt: skip
        optimizer = torch.optim.SGD if cfg.hn_optimizer == "sgd" else torch.optim.AdamW
        self.optimizer = optimizer(groups, lr=cfg.hn_server_lr)

    def new_encoder(self) -> Encoder:
        """The network that turns a client's data into its descriptor (by strategy name)."""
        return ENCODERS[self.name](self.input_shape, self.cfg.num_classes, self.embed_dim)

    def config(self, server_round: int, **extra) -> dict:
        return self.client_config(server_round, embed_dim=self.embed_dim, **extra)

    def describe(self, server_round: int, nodes: list[NodeInfo], **flags: bool) -> dict[int, Reply]:
        """η_v down, each node's descriptor v up (over its whole train split with `predict`)."""
        request = protocol.content(protocol.to_record(self.embed), self.config(server_round, **flags))
        reference = {DESCRIPTOR: torch.zeros(self.embed_dim)}
        return self.broadcast(nodes, protocol.DESCRIBE, server_round, request, ("num-examples",), reference)

    def train_round(self, server_round: int, nodes: list[NodeInfo]) -> float | None:
        described = self.describe(server_round, nodes)
        v = {node: r.arrays[DESCRIPTOR].clone().requires_grad_() for node, r in described.items()}
        theta = {node: self.hyper(v[node]) for node in v}
        config = self.config(server_round)
        requests = {node: protocol.content(ArrayRecord(t), config) for node, t in theta.items()}
        trained = self.ask(requests, protocol.TRAIN_GENERATED, server_round, TRAINED, self.template)
        # Δv_i = (∂θ_i/∂v_i)ᵀ Δθ_i, a vector-Jacobian product through h.
        dv = {node: torch.autograd.grad(_inner(theta[node], r.arrays), v[node], retain_graph=True)[0]
              for node, r in trained.items()}  # fmt: skip
        requests = {node: protocol.content(ArrayRecord({DESCRIPTOR: g}), config) for node, g in dv.items()}
        embedded = self.ask(requests, protocol.TRAIN_ENCODER, server_round, ("num-examples",), self.embed.state_dict())
        # Only clients that completed all three exchanges count; fixed order: same seed, same sums.
        done = [n.node_id for n in nodes if n.node_id in embedded]
        if done:
            self.update({n: (theta[n], trained[n].arrays, embedded[n].arrays) for n in done})
        return mean_loss(trained[n].metrics for n in done)

    def update(self, steps: dict[int, tuple[Params, Params, Params]]) -> None:
        """η ← (1 − 2βλ)η + β·mean Δη from (θ_i, Δθ_i, Δη_v,i) per client. Δη_h,i = J_iᵀΔθ_i
        comes from one backward pass through Σ_i ⟨θ_i, Δθ_i⟩."""
        self.optimizer.zero_grad()
        (-sum(_inner(theta, delta) for theta, delta, _ in steps.values()) / len(steps)).backward()
        for name, param in self.embed.named_parameters():
            param.grad = -sum(d[name] for _, _, d in steps.values()) / len(steps)
        self.optimizer.step()

    def evaluate(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        return self.predict(server_round, nodes, serve=False)

    def serve(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        return self.predict(server_round, nodes, serve=True)

    def predict(self, server_round: int, nodes: list[NodeInfo], serve: bool) -> dict[int, dict[str, float]]:
        """η_v down, v up, θ = h(v) down, test metrics up (PeFLL-predict). Nodes being served
        may hold no labels (OD-PFL): they keep their model and report no accuracy. Each row
        carries the descriptor's sample count and, when noised, its privacy settings."""
        described = self.describe(server_round, nodes, predict=True, serve=serve)
        config = self.config(server_round)
        with torch.no_grad():
            requests = {node: protocol.content(ArrayRecord(self.hyper(r.arrays[DESCRIPTOR])), config)
                        for node, r in described.items()}  # fmt: skip
        scored = self.ask(requests, protocol.EVALUATE_GENERATED, server_round, ("num-examples",) if serve else TESTED)
        return {node: reply.metrics | _descriptor_fields(described[node].metrics) for node, reply in scored.items()}

    def state(self) -> dict[str, torch.Tensor]:
        nets = {"hyper": self.hyper, "embed": self.embed}
        return {f"{prefix}.{k}": v for prefix, net in nets.items() for k, v in net.state_dict().items()}


def _inner(theta: Params, delta: Params) -> torch.Tensor:
    """⟨θ, Δθ⟩ summed over all tensors; its gradient is the vector-Jacobian product with Δθ."""
    return sum((theta[k] * delta[k]).sum() for k in theta)


def _descriptor_fields(metrics: dict[str, float]) -> dict[str, float]:
    """What a node said about its descriptor: how many samples, and any privacy settings."""
    return {"descriptor-size": metrics["num-examples"]} | {k: v for k, v in metrics.items() if k.startswith("dp-")}
