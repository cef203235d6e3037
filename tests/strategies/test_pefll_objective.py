"""PeFLL's (and OD-PFL's) round against autograd of the centralized objective it descends,
with every term switched on, so that an error in any of them shows.

With one local SGD step of size α (on the whole train split) and the server's plain SGD of
step s, Algorithm 2's round over n clients is η ← η − s·∇F(η), where

    F(η) = α · (1/n) Σ_i [ L_i(h(v_i; η_h)) + λ_θ ‖h(v_i; η_h)‖² ] + λ_h ‖η_h‖² + λ_v ‖η_v‖²,
    v_i  = mean_{(x, y) ∈ B_i} φ(x, y; η_v),

L_i the cross-entropy on client i's train split and B_i the descriptor batch of message 1
(PeFLL: `hn-batch` samples drawn from (seed, round, node), fewer than the split; OD-PFL: the
split's x, no labels). Several clients tell a mean from a sum, a batch smaller than the split
tells message 1's samples from the split's, and each regularizer is checked to move the
networks by far more than the test's tolerance, so none is checked only by being small."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Context, Message

from florist.apps.client import build_client_app
from florist.apps.server import server_half
from florist.client.node import node_data
from florist.common import protocol, training
from florist.common.models import build_model
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.strategies.pefll.spec import DESCRIBE, DESCRIPTOR

CLIENTS = 3
ALPHA, SERVER_LR = 0.5, 1.0  # the clients' step α and the server's step s
L2 = {"l2_model": 0.01, "l2_hyper": 0.002, "l2_embed": 0.001}  # λ_θ, λ_h, λ_v (`hn-l2-*`)
BATCH = 6  # samples per PeFLL descriptor: a few of a split's hundreds
ROUND = 1
TOLERANCE = 1e-4  # relative to the step's norm; float32 reaches a few 1e-6
TERMS = {"λ_θ": ("l2_model", ("hyper", "embed")), "λ_h": ("l2_hyper", ("hyper",)), "λ_v": ("l2_embed", ("embed",))}


def record_descriptors(sent: dict[int, torch.Tensor]):
    """A Flower mod: the first descriptor each node sends (message 1 of round 1; the final
    evaluation's come after the update), by partition."""

    def mod(msg: Message, context: Context, call_next):
        reply = call_next(msg, context)
        if msg.metadata.message_type == DESCRIBE.message_type:
            arrays = reply.content.array_records[protocol.ARRAYS].to_torch_state_dict()
            sent.setdefault(int(context.node_config["partition-id"]), arrays[DESCRIPTOR])
        return reply

    return mod


def _config(tmp_path, strategy: str) -> RunConfig:
    return RunConfig.from_mapping(
        {
            "strategy": strategy,
            "num-server-rounds": ROUND,
            "partition": "dirichlet:0.5",
            "unseen-fraction": 0.0,
            "min-nodes": CLIENTS,
            "min-train-nodes": CLIENTS,
            "eval-every": 0,
            "results-dir": str(tmp_path / strategy),
            "lr": ALPHA,
            "momentum": 0.0,
            "batch-size": 4096,  # the one local step sees the whole train split
            "hn-batch": BATCH,
            "hn-local-steps": 1,
            "hn-optimizer": "sgd",
            "hn-server-lr": SERVER_LR,
            "hn-grad-clip": 0.0,
            "hn-embed-dim": 3,
        }
        | {"hn-" + name.replace("_", "-"): value for name, value in L2.items()}
    )


def _descriptor_samples(cfg: RunConfig, i: int, uses_labels: bool):
    """(X_i, Y_i, x and y of B_i) of partition i, as its handlers see them; B_i is drawn as the
    client's docstring says: `hn-batch` of the train split, seeded by (seed, round, node)."""
    d = node_data({"partition-id": i, "num-partitions": CLIENTS}, cfg)
    x, y = training.inputs(d.x_train), torch.from_numpy(d.y_train)
    if not uses_labels:
        return x, y, x, None
    rng = np.random.default_rng([cfg.seed, ROUND, zlib.crc32(f"partition-{i}".encode())])
    batch = torch.from_numpy(np.sort(rng.choice(len(x), BATCH, replace=False)))
    assert BATCH < len(x) // 10, "the descriptor batch must be a small part of the split"
    return x, y, x[batch], y[batch]


def _objective(server, cfg: RunConfig, l2_model: float, l2_hyper: float, l2_embed: float):
    """F(η) written out (module docstring), and each client's descriptor v_i on the way."""
    template = build_model(cfg.model, (1, 8, 8), cfg.num_classes)
    clients, descriptors = 0.0, {}
    for i in range(CLIENTS):
        x, y, bx, by = _descriptor_samples(cfg, i, server.embed.uses_labels)
        v = server.embed.describe(bx, by)
        theta = server.hyper(v)
        loss = F.cross_entropy(torch.func.functional_call(template, theta, (x,)), y)
        clients = clients + loss + l2_model * sum((t**2).sum() for t in theta.values())
        descriptors[i] = v.detach()
    squares = {net: sum((p**2).sum() for p in getattr(server, net).parameters()) for net in ("hyper", "embed")}
    total = ALPHA * clients / CLIENTS + l2_hyper * squares["hyper"] + l2_embed * squares["embed"]
    return total, descriptors


def _expected_step(cfg: RunConfig, strategy: str, **l2: float):
    """−s·∇F at the networks the run starts from (the server half rebuilt from the same seed),
    flattened per network, with the λs given (the run's by default)."""
    server = server_half(strategy)(cfg, None, (1, 8, 8), CLIENTS)
    total, descriptors = _objective(server, cfg, **L2 | l2)
    nets = {"hyper": server.hyper, "embed": server.embed}
    grads = torch.autograd.grad(total, [p for net in nets.values() for p in net.parameters()])
    steps, start, at = {}, {}, 0
    for name, net in nets.items():
        params = list(net.named_parameters())
        steps[name] = torch.cat([-SERVER_LR * g.flatten() for g in grads[at : at + len(params)]])
        start[name] = {k: p.detach() for k, p in params}
        at += len(params)
    return steps, start, descriptors


@pytest.mark.parametrize("strategy", ["pefll", "odpfl"])
def test_a_round_of_several_clients_is_one_step_down_the_centralized_objective(tmp_path, strategy):
    cfg = _config(tmp_path, strategy)
    sent: dict[int, torch.Tensor] = {}
    results = run_in_process(cfg, CLIENTS, client_app=build_client_app([record_descriptors(sent)]))
    assert results["complete"] and not results["failures"]
    after = torch.load(tmp_path / strategy / "checkpoint.pt")["state"]

    expected, start, descriptors = _expected_step(cfg, strategy)
    for i in range(CLIENTS):  # message 1 described B_i, as the objective does
        torch.testing.assert_close(sent[i], descriptors[i], atol=1e-5, rtol=1e-4, msg=lambda m: f"client {i}: {m}")
    for net in ("hyper", "embed"):
        got = torch.cat([(after[net][k] - p).flatten() for k, p in start[net].items()])
        assert expected[net].norm() > 1e-3, net  # each network really moves through the chain
        error = float((got - expected[net]).norm() / expected[net].norm())
        assert error < TOLERANCE, f"{net}: the round is not −s·∇F (relative error {error:.2e})"
    # Each term moves the networks it reaches by far more than that tolerance.
    for term, (key, nets) in TERMS.items():
        other = _expected_step(cfg, strategy, **{key: 0.0})[0]
        for net in nets:
            assert (other[net] - expected[net]).norm() > 100 * TOLERANCE * expected[net].norm(), (term, net)
