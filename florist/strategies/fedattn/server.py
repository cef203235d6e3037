"""FedAttn's server half. G is trained by FedAvg; the server keeps every trained client's
latest representation Z and biases M, gives a sampled client i G with
`M̃_i = Attention(Z_i, Z_N, M_N)` over its K nearest clients by Z (a FAISS search), and trains
W_Q, W_K, W_V with the client's gradient at M̃_i. G and M̄ are aggregated as FedAvg's model is,
by the run's `aggregation` rule (with `clip-norm` and the weight caps); under a robust rule the
M the attention reads are bounded too (`bounded`).

A trained client's own (Z, M) is one of its K (`fedattn-include-self`, the default; off: its K
nearest others). A sampled client the server has no (Z, M) of trains from M̄ and does not train
the attention (`train_round`).

Stability (the paper's runs broke at random rounds): `fedattn-warmup` FedAvg-only rounds
first, attention over deviations from the mean biases (`fedattn-residual`), a penalty on
‖M̃_i − M̄‖² (`fedattn-reg`) and a clipped gradient norm (`fedattn-clip`).
"""

from __future__ import annotations

import math
from typing import Any

import faiss
import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn

from florist.common import protocol
from florist.common.models import bias_names, flat_biases, seeded
from florist.server.aggregation import clip_updates, weighted_average
from florist.server.strategy import TESTED, NodeInfo, log
from florist.strategies.fedattn.spec import BIAS_GRAD, REPRESENT, TRAIN_ATTN, AttentionSettings, M, Z
from florist.strategies.fedavg.server import FedAvg
from florist.strategies.fedavg.spec import EVALUATE

MAX_BIASES = 4096  # W_V is m×m


class BiasAttention(nn.Module):
    """`M̃ = softmax((W_K Z_N)ᵀ(W_Q z)/√d_k) · W_V M_N`; with `residual`, over M_N − M̄ and
    added to M̄. W_V starts as the identity: at first M̃ is a weighted mean of the neighbours'."""

    def __init__(self, z_dim: int, m_dim: int, key_dim: int, residual: bool):
        super().__init__()
        self.query, self.key = nn.Linear(z_dim, key_dim, bias=False), nn.Linear(z_dim, key_dim, bias=False)
        self.value = nn.Linear(m_dim, m_dim, bias=False)
        nn.init.eye_(self.value.weight)
        self.residual = residual

    def weights(self, z: torch.Tensor, z_n: torch.Tensor) -> torch.Tensor:
        """Attention weights of query z over the K keys Z_N (K×d_z); they sum to 1."""
        return torch.softmax(self.key(z_n) @ self.query(z) / math.sqrt(self.query.out_features), dim=0)

    def forward(self, z: torch.Tensor, z_n: torch.Tensor, m_n: torch.Tensor, m_bar: torch.Tensor) -> torch.Tensor:
        a = self.weights(z, z_n)
        if self.residual:
            return m_bar + a @ self.value(m_n - m_bar)
        return a @ self.value(m_n)


class FedAttn(FedAvg):
    settings: AttentionSettings
    checkpointed = ("model", "attention", "optimizer")
    # Under secure aggregation G's update is masked; Z, M and ∂L/∂M̃ stay in the clear (`train_masked`).
    secured = ("fedattn",)
    # Under record-level dp (its spec's `record_covered`) G and M are DP-SGD's output, and Z and ∂L/∂M̃ are each
    # one more DP-SGD step's noised mean, counted in the node's ledger (florist/strategies/fedattn/client.py).

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg, attn = self.cfg, self.settings
        self.biases = bias_names(self.model)
        m_dim = sum(self.model.state_dict()[n].numel() for n in self.biases)
        if m_dim > MAX_BIASES:
            raise ValueError(f"fedattn: model {cfg.model!r} has {m_dim} biases; W_V (m×m) allows at most {MAX_BIASES}")
        with torch.no_grad():
            z_dim = self.model.features(torch.zeros(1, *self.input_shape)).shape[1]
        with seeded(cfg.seed):
            self.attention = BiasAttention(z_dim, m_dim, attn.key_dim, attn.residual)
        self.attention.to(self.device)  # built on the CPU: the same start on any device
        self.optimizer = torch.optim.Adam(self.attention.parameters(), lr=attn.lr)
        self.z_dim, self.m_dim = z_dim, m_dim
        self.memory: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # node key -> latest (Z, M)
        self.index, self.index_keys = faiss.IndexFlatL2(z_dim), []  # over the memory's Z, in `remember`

    # -- the attention -------------------------------------------------------------------
    def mean_biases(self) -> torch.Tensor:
        """M̄: the FedAvg model's biases (the sample-weighted mean of the clients' M)."""
        return flat_biases(self.model.state_dict(), self.biases)

    def remember(self, latest: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep these clients' latest (Z, M) and rebuild the index over every Z once."""
        self.memory |= latest
        self.index_keys = sorted(self.memory)
        self.index = faiss.IndexFlatL2(self.z_dim)
        self.index.add(np.stack([self.memory[k][0].numpy() for k in self.index_keys]).astype(np.float32))

    def neighbours(self, z: torch.Tensor, key: str = "") -> list[str]:
        """The keys of the K known clients nearest to z (squared L2, exact FAISS search). A
        trained client's own stored Z is z itself, at distance 0: it is one of its K unless
        `fedattn-include-self` is off, when client `key` is left out and K others are read."""
        exclude = key if key in self.memory and not self.settings.include_self else None
        count = min(self.settings.k + (exclude is not None), len(self.index_keys))
        _, found = self.index.search(z.numpy()[None].astype(np.float32), count)
        near = [self.index_keys[i] for i in found[0] if i >= 0 and self.index_keys[i] != exclude]
        return near[: self.settings.k]

    def personalize(self, z: torch.Tensor, key: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """(M̃, attention weights) for client `key` with representation z (M̃ keeps its graph,
        on the server's device). Without a usable neighbour, or when the attention's output is
        not finite, the client gets M̄ and no weights, so a broken attention cannot spread NaN
        to the clients."""
        near = self.neighbours(z, key)
        if not near:
            return self.mean_biases(), torch.ones(0)
        z, device = z.to(self.device), self.device
        z_n = torch.stack([self.memory[k][0] for k in near]).to(device)
        m_n = torch.stack([self.memory[k][1] for k in near]).to(device)
        m_tilde = self.attention(z, z_n, m_n, self.mean_biases().to(device))
        if torch.isfinite(m_tilde).all():
            return m_tilde, self.attention.weights(z, z_n).detach().cpu()
        log.warning("fedattn: no finite attention output for a client; it gets the mean biases")
        return self.mean_biases(), torch.ones(0)

    def attending(self, server_round: int) -> bool:
        return server_round > self.settings.warmup and bool(self.memory)

    def with_biases(self, m: torch.Tensor) -> dict[str, torch.Tensor]:
        """The global model's state with its biases replaced by m."""
        state, offset = {k: v.clone() for k, v in self.model.state_dict().items()}, 0
        for name in self.biases:
            size = state[name].numel()
            state[name] = m[offset : offset + size].detach().cpu().reshape(state[name].shape).clone()
            offset += size
        return state

    def backprop(self, m_tildes: list[torch.Tensor], gradients: list[torch.Tensor], m_bar: torch.Tensor) -> None:
        """Gradients of W_Q, W_K, W_V from the clients' ∂L/∂M̃_i (mean over the clients), plus
        the penalty `fedattn-reg`·mean ‖M̃_i − M̄‖²: the chain rule through the attention."""
        self.optimizer.zero_grad()
        m_bar, gradients = m_bar.to(self.device), [g.to(self.device) for g in gradients]
        loss = sum((m * g).sum() + self.settings.reg * ((m - m_bar) ** 2).sum() for m, g in zip(m_tildes, gradients))
        (loss / len(m_tildes)).backward()

    def step(self) -> None:
        if self.settings.clip > 0:
            nn.utils.clip_grad_norm_(self.attention.parameters(), self.settings.clip)
        self.optimizer.step()

    # -- rounds --------------------------------------------------------------------------
    def train_round(self, server_round: int, nodes: list[NodeInfo]) -> float | None:
        """Each sampled node trains G with its M̃_i and replies with its model, Z_i and ∂L/∂M̃_i;
        W_Q, W_K, W_V take one step on the mean over the attended nodes, then G and M̄ are
        aggregated and every reply's (Z, M) is remembered.

        A sampled node the server keeps no (Z, M) of (sampled for the first time, or joining
        late), every node during the warm-up, and a node whose attention output is unusable
        train from M̄, as in FedAvg. The paper defines M̃_i only from a stored Z_i and says
        nothing of this case. M̄ does not depend on W_Q, W_K, W_V, so such a node's gradient
        would move them by exactly 0: it is not used, and the step is the mean over the
        attended nodes alone (not diluted by the others). Its model still counts for G and M̄,
        and its Z and M are remembered, so it is attended from its next sampled round. Asking
        it for Z first, as `evaluate` does, would add an exchange to every such round."""
        m_bar = self.mean_biases()
        m_tilde, states = {}, {}
        for node in nodes:
            states[node.node_id] = self.model.state_dict()
            if self.attending(server_round) and node.key in self.memory:
                m, weights = self.personalize(self.memory[node.key][0], node.key)
                states[node.node_id] = self.with_biases(m)
                if len(weights):  # made by the attention: its gradient trains it
                    m_tilde[node.node_id] = m
        side = {Z: torch.zeros(self.z_dim), BIAS_GRAD: torch.zeros(self.m_dim)}
        if self.secure:
            loss, sides, biases = self.train_masked(server_round, nodes, states, side)
        else:
            requests = {n: self.request(TRAIN_ATTN, server_round, ArrayRecord(s)) for n, s in states.items()}
            replies = self.ask(TRAIN_ATTN, requests, server_round, self.trained_metrics, self.model.state_dict(), side)
            done = [n for n in nodes if n.node_id in replies]  # fixed order: same seed, same sums
            # G (with M̄) by FedAvg's rule, or the robust one the run config names (florist/server/aggregation.py).
            loss = self.aggregate([(n, replies[n.node_id]) for n in done]) if done else None
            sides = {n.node_id: replies[n.node_id].side for n in done}
            biases = {n.node_id: flat_biases(replies[n.node_id].arrays, self.biases) for n in done}
        done = [n for n in nodes if n.node_id in sides]
        if not done:
            return None
        attended = [n for n in done if n.node_id in m_tilde]
        if attended:
            gradients = [sides[n.node_id][BIAS_GRAD] for n in attended]
            self.backprop([m_tilde[n.node_id] for n in attended], gradients, m_bar)
            self.step()
        kept = [biases[n.node_id] for n in done]
        if not self.aggregator.plain:
            kept = self.bounded(kept)
        self.remember({n.key: (sides[n.node_id][Z], m) for n, m in zip(done, kept)})
        return loss

    def train_masked(self, server_round: int, nodes: list[NodeInfo], states: dict[int, dict], side: dict):
        """The round under `secure-aggregation`: G's update summed through SecAgg+'s four exchanges
        (FedAvg's, each node sent its own biases), and Z, ∂L/∂M̃ and its new biases M from each
        node in the clear, which the attention needs one by one. M̄ is then the survivors' M
        weighted by the train sizes they reported at discovery, capped as the plain round caps a
        node's weight (`max-node-examples`): the masked mean of M − M̃ is not it, as each node
        started from its own M̃. Returns the round's loss and each survivor's side and biases, by
        node id."""
        sent = {n: ArrayRecord(s) for n, s in states.items()}
        side = side | {M: torch.zeros(self.m_dim)}
        loss, outcome = self.train_securely(server_round, nodes, lambda n: sent[n.node_id], side)
        biases = {n.node_id: outcome.sides[n.node_id][M] for n in outcome.survivors}
        weights = [self.aggregator.weight(n.num_train, n.num_train) for n in outcome.survivors]
        mean = weighted_average([{M: biases[n.node_id]} for n in outcome.survivors], weights)[M]
        self.model.load_state_dict(self.with_biases(mean))
        return loss, outcome.sides, biases

    def bounded(self, biases: list[torch.Tensor]) -> list[torch.Tensor]:
        """Under a robust aggregation, the clients' M to remember, each one's distance to the
        new M̄ clipped to the round's median distance. The attention mixes the neighbours' M
        into every client's biases, so one node's M would carry its attack past the robust G;
        while fewer than half the nodes lie, the median distance is an honest node's."""
        m_bar = self.mean_biases()
        bound = float(torch.stack([(m.double() - m_bar.double()).norm() for m in biases]).median())
        clipped, _ = clip_updates([{"m": m} for m in biases], {"m": m_bar}, bound)
        return [c["m"] for c in clipped]

    def evaluate(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        """Each node tests G with its M̃ (G with M̄ during warm-up). A node the server has no
        Z of (held out, never sampled, joining late) first sends Z under the global model."""
        z = {n.node_id: self.memory[n.key][0] for n in nodes if n.key in self.memory}
        if self.attending(server_round):
            request = self.request(REPRESENT, server_round, protocol.to_record(self.model))
            unknown = [n for n in nodes if n.node_id not in z]
            described = self.broadcast(
                REPRESENT, unknown, server_round, request, ("num-examples",), side={Z: torch.zeros(self.z_dim)}
            )
            z |= {node: reply.side[Z] for node, reply in described.items()}
        requests, extra = {}, {}
        for node in nodes:
            state = self.model.state_dict()
            if self.attending(server_round) and node.node_id in z:
                with torch.no_grad():
                    m, weights = self.personalize(z[node.node_id], node.key)
                state = self.with_biases(m)
                extra[node.node_id] = {
                    "neighbours": len(weights),
                    "attention-max": float(weights.max(0).values) if len(weights) else 0.0,
                    "bias-shift": float((m.cpu() - self.mean_biases()).norm()),
                }
            requests[node.node_id] = self.request(EVALUATE, server_round, ArrayRecord(state))
        replies = self.ask(EVALUATE, requests, server_round, TESTED)
        return {node: reply.metrics | extra.get(node, {}) for node, reply in replies.items()}

    def state(self) -> dict[str, Any]:
        return super().state() | {"memory": {key: list(zm) for key, zm in self.memory.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.memory = {}
        if state["memory"]:
            self.remember({key: (z, m) for key, (z, m) in state["memory"].items()})
