"""Client half of PeFLL (Scott et al., 2024), three messages per training round:

1. `describe`: receive the embedding network η_v; return v = mean φ(x, y) over a seeded batch
   of the train split (over the whole split when the server asks for a prediction);
2. `train`: receive θ = h(v); run k SGD steps on L(θ) + λ_θ‖θ‖²; return Δθ;
3. `backprop`: receive Δv; return Δη_v = (∂v/∂η_v)ᵀ Δv, on the same batch as in 1.

η_v is kept in `context.state` between messages 1 and 3 (it lives for the run only), so it
travels down once per round. `evaluate` scores a received θ as it is: PeFLL-predict.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from florist.client.fedavg import received_model
from florist.client.node import Node
from florist.common import protocol
from florist.common.hypernet import EmbeddingNet

STATE_KEY = "pefll-embedding-net"  # η_v from message 1 (an ArrayRecord in context.state)
ROUND_KEY = "pefll-round"  # ... and its round (a ConfigRecord: one RecordDict key holds one record)
DESCRIPTOR = "descriptor"  # the ArrayRecord key of v (up, message 1) and of Δv (down, message 3)


def _embedding_net(node: Node, content: RecordDict) -> EmbeddingNet:
    config = content.config_records.get(protocol.CONFIG, {})
    if "embed-dim" not in config:
        raise protocol.ProtocolError(f"node {node.key}: PeFLL message without 'embed-dim' in its config")
    return EmbeddingNet(node.data.input_shape, node.cfg.num_classes, int(config["embed-dim"]))


def _batch(node: Node, whole: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples the descriptor averages over: a batch drawn from (seed, round, node), so that
    messages 1 and 3 of a round see the same one, or the whole train split."""
    d = node.data
    if not d.labelled:
        raise ValueError(f"node {node.key}: PeFLL describes a client by (x, y), but the node's data has no labels")
    index = np.arange(len(d.x_train))
    if not whole:
        rng = np.random.default_rng([node.cfg.seed, node.server_round, zlib.crc32(node.key.encode())])
        index = np.sort(rng.choice(index, min(node.cfg.pefll_batch, len(index)), replace=False))
    return torch.from_numpy(d.x_train[index]), torch.from_numpy(d.y_train[index])


def describe(node: Node, content: RecordDict, state: RecordDict) -> RecordDict:
    """Message 1 (and the first of PeFLL-predict): the descriptor under the received η_v."""
    net = _embedding_net(node, content)
    net.load_state_dict(protocol.arrays_of(content, net.state_dict(), f"node {node.key}: the server's message"))
    predict = bool(content.config_records[protocol.CONFIG].get("predict", False))
    x, y = _batch(node, whole=predict)
    with torch.no_grad():
        v = net.describe(x, y)
    if not predict:
        state.array_records[STATE_KEY] = ArrayRecord(net.state_dict())
        state.config_records[ROUND_KEY] = ConfigRecord({"server-round": node.server_round})
    return protocol.content(ArrayRecord({DESCRIPTOR: v}), metrics={"num-examples": len(x)})


def train(node: Node, content: RecordDict) -> RecordDict:
    """Message 2: k local SGD steps from θ on L(θ) + λ_θ‖θ‖² (weight decay 2λ_θ); reply Δθ."""
    model = received_model(node, content)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = node.cfg
    loss = node.fit(model, 1, steps=cfg.pefll_local_steps, weight_decay=2 * cfg.pefll_l2_model)
    delta = {k: v - start[k] for k, v in model.state_dict().items()}
    return protocol.content(ArrayRecord(delta), metrics={"num-examples": len(node.data.x_train), "train-loss": loss})


def backprop(node: Node, content: RecordDict, state: RecordDict) -> RecordDict:
    """Message 3: Δv backpropagated through φ on message 1's batch; reply Δη_v."""
    stored = state.config_records.get(ROUND_KEY, {})
    if STATE_KEY not in state.array_records or stored.get("server-round") != node.server_round:
        raise protocol.ProtocolError(
            f"node {node.key}: no embedding network from message 1 of round {node.server_round} "
            f"(this node holds round {stored.get('server-round')})"
        )
    net = _embedding_net(node, content)
    net.load_state_dict(state.array_records[STATE_KEY].to_torch_state_dict())
    reference = {DESCRIPTOR: torch.zeros(net.head[-1].out_features)}
    dv = protocol.arrays_of(content, reference, f"node {node.key}: the server's message")[DESCRIPTOR]
    x, y = _batch(node, whole=False)
    names, params = zip(*net.named_parameters())
    grads = torch.autograd.grad(net.describe(x, y), params, grad_outputs=dv)
    return protocol.content(ArrayRecord(dict(zip(names, grads))), metrics={"num-examples": len(x)})


def evaluate(node: Node, content: RecordDict) -> RecordDict:
    """PeFLL-predict's last step: score θ = h(v) as received; no training."""
    return node.test_reply(received_model(node, content))
