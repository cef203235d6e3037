"""Client half of the hypernetwork strategies: PeFLL (Scott et al., 2024) and OD-PFL
(ODPFL-HN), which differ only in the encoder (`common/hypernet.py`). Three messages per
training round:

1. `describe`: receive the encoder η_v; return the descriptor v: PeFLL's mean φ(x, y) over a
   seeded batch of the train split (the whole split when predicting), or OD-PFL's set encoding
   of the whole train split's x, never its labels;
2. `train`: receive θ = h(v); run k SGD steps on L(θ) + λ_θ‖θ‖²; return Δθ;
3. `backprop`: receive Δv; return Δη_v = (∂v/∂η_v)ᵀ Δv, on the same samples as in 1.

η_v is kept in `context.state` between messages 1 and 3 (it lives for the run only), so it
travels down once per round. `evaluate` receives θ = h(v) and keeps it (predict: no training).
A node being served under OD-PFL with a finite `dp-epsilon` adds Gaussian noise to its
descriptor before sending it (`common/privacy.py`): the server never sees the clean one.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from florist.client.fedavg import received_model
from florist.client.node import Node
from florist.common import privacy, protocol
from florist.common.hypernet import ENCODERS, Encoder

STATE_KEY = "hn-encoder"  # η_v from message 1 (an ArrayRecord in context.state)
ROUND_KEY = "hn-round"  # ... and its round (a ConfigRecord: one RecordDict key holds one record)
DESCRIPTOR = "descriptor"  # the ArrayRecord key of v (up, message 1) and of Δv (down, message 3)
MODEL_FILE = "generated-model.npz"  # the last θ = h(v) received, in the node's state folder


def _encoder(node: Node, content: RecordDict) -> Encoder:
    config = content.config_records.get(protocol.CONFIG, {})
    if "embed-dim" not in config:
        raise protocol.ProtocolError(f"node {node.key}: {node.cfg.strategy} message without 'embed-dim' in its config")
    return ENCODERS[node.cfg.strategy](node.data.input_shape, node.cfg.num_classes, int(config["embed-dim"]))


def _samples(node: Node, encoder: Encoder, whole: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the descriptor averages over. OD-PFL: the train split's x, never a label. PeFLL:
    (x, y) pairs of a batch drawn from (seed, round, node), so that messages 1 and 3 of a round
    see the same one, or of the whole train split."""
    d = node.data
    if not encoder.uses_labels:
        return torch.from_numpy(d.x_train), None
    if not d.labelled:
        raise ValueError(f"node {node.key}: PeFLL describes a client by (x, y), but the node's data has no labels")
    index = np.arange(len(d.x_train))
    if not whole:
        rng = np.random.default_rng([node.cfg.seed, node.server_round, zlib.crc32(node.key.encode())])
        index = np.sort(rng.choice(index, min(node.cfg.hn_batch, len(index)), replace=False))
    return torch.from_numpy(d.x_train[index]), torch.from_numpy(d.y_train[index])


def _privacy(node: Node) -> tuple[float, float]:
    """(ε, δ): the node config's `dp-epsilon` / `dp-delta` over the run's."""
    epsilon = float(node.node_config.get("dp-epsilon", node.cfg.dp_epsilon))
    return epsilon, float(node.node_config.get("dp-delta", node.cfg.dp_delta))


def describe(node: Node, content: RecordDict, state: RecordDict) -> RecordDict:
    """Message 1 (and the first of predict): the descriptor under the received encoder."""
    encoder = _encoder(node, content)
    encoder.load_state_dict(protocol.arrays_of(content, encoder.state_dict(), f"node {node.key}: the server's message"))
    config = content.config_records[protocol.CONFIG]
    predict, serve = bool(config.get("predict", False)), bool(config.get("serve", False))
    x, y = _samples(node, encoder, whole=predict)
    with torch.no_grad():
        v = encoder.describe(x, y, chunk=node.cfg.odpfl_encode_batch)
    metrics = {"num-examples": len(x)}
    if serve and not encoder.uses_labels:
        epsilon, delta = _privacy(node)
        sigma = privacy.gaussian_sigma(epsilon, delta, len(x))
        v = privacy.privatize(v, sigma) if sigma > 0 else v
        metrics |= {"dp-sigma": sigma} | ({} if math.isinf(epsilon) else {"dp-epsilon": epsilon, "dp-delta": delta})
    if not predict:
        state.array_records[STATE_KEY] = ArrayRecord(encoder.state_dict())
        state.config_records[ROUND_KEY] = ConfigRecord({"server-round": node.server_round})
    return protocol.content(ArrayRecord({DESCRIPTOR: v}), metrics=metrics)


def train(node: Node, content: RecordDict) -> RecordDict:
    """Message 2: k local SGD steps from θ on L(θ) + λ_θ‖θ‖² (weight decay 2λ_θ); reply Δθ."""
    model = received_model(node, content)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = node.cfg
    loss = node.fit(model, 1, steps=cfg.hn_local_steps, weight_decay=2 * cfg.hn_l2_model)
    delta = {k: v - start[k] for k, v in model.state_dict().items()}
    return protocol.content(ArrayRecord(delta), metrics={"num-examples": len(node.data.x_train), "train-loss": loss})


def backprop(node: Node, content: RecordDict, state: RecordDict) -> RecordDict:
    """Message 3: Δv backpropagated through the encoder on message 1's samples; reply Δη_v."""
    stored = state.config_records.get(ROUND_KEY, {})
    if STATE_KEY not in state.array_records or stored.get("server-round") != node.server_round:
        raise protocol.ProtocolError(
            f"node {node.key}: no encoder from message 1 of round {node.server_round} "
            f"(this node holds round {stored.get('server-round')})"
        )
    encoder = _encoder(node, content)
    encoder.load_state_dict(state.array_records[STATE_KEY].to_torch_state_dict())
    x, y = _samples(node, encoder, whole=False)
    v = encoder.describe(x, y, chunk=node.cfg.odpfl_encode_batch)
    dv = protocol.arrays_of(content, {DESCRIPTOR: v.detach()}, f"node {node.key}: the server's message")[DESCRIPTOR]
    names, params = zip(*encoder.named_parameters())
    grads = torch.autograd.grad(v, params, grad_outputs=dv)
    return protocol.content(ArrayRecord(dict(zip(names, grads))), metrics={"num-examples": len(x)})


def evaluate(node: Node, content: RecordDict) -> RecordDict:
    """Predict's last step: keep θ = h(v) in the node's state folder, where the node's own
    code can load it, and score it as received when the node has test labels."""
    model = received_model(node, content)
    node.state.save_arrays(MODEL_FILE, {k: v.numpy() for k, v in model.state_dict().items()})
    if node.data.y_test is None:  # an unlabeled node: it gets its model, nobody can score it
        return protocol.content(metrics={"num-examples": 0, "num-train": len(node.data.x_train), "seen": int(node.seen)})
    return node.test_reply(model)
