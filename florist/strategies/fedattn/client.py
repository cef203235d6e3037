"""FedAttn's client half: the server sends G with biases M̃_i its attention made for this
client; the client trains the whole model as FedAvg does and returns it (G and its own new
biases M_i) with, beside it, its representation Z_i (the last hidden layer averaged over its
train split) and ∂L/∂M̃_i, the gradient of its training loss at the biases it received: the
server trains its attention through that gradient. Under secure aggregation the model's update
goes masked (FedAvg's `train.secagg`) and the new biases M_i join Z_i and the gradient in the
clear: the server's attention needs each one. The client keeps nothing."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, RecordDict

from florist.client.node import Node, Request
from florist.common import protocol, training
from florist.common.models import Net, bias_names, flat_biases
from florist.strategies.fedattn.spec import BIAS_GRAD, M, Z


def representation(node: Node, model: Net) -> torch.Tensor:
    """Z: `model.features` averaged over the node's train split."""
    return torch.from_numpy(training.embed(model, node.data.x_train, device=node.device).mean(0))


def bias_gradient(node: Node, model: Net) -> torch.Tensor:
    """∂L/∂M at the model's current biases, L the mean cross-entropy over the train split (in
    eval mode, in the model's dtype). Sent at the M̃_i the server made, before any local step:
    by the chain rule the server gets ∂L/∂W = (∂M̃_i/∂W)ᵀ·∂L/∂M̃_i for W_Q, W_K, W_V."""
    if not node.data.labelled:
        raise ValueError(f"node {node.key}: FedAttn trains on labels, but the node's data has no y")
    names, d = bias_names(model), node.data
    with training.on_device(model, node.device) as device:
        model.eval()
        params = dict(model.named_parameters())
        targets = torch.from_numpy(np.array(d.y_train)).to(device)  # a copy: memory-mapped labels are read-only
        x = training.inputs(d.x_train, device).to(next(model.parameters()).dtype)
        loss = F.cross_entropy(model(x), targets)
        grads = [g.cpu() for g in torch.autograd.grad(loss, [params[n] for n in names])]
    return flat_biases(dict(zip(names, grads)), names)


def train(node: Node, request: Request) -> RecordDict:
    """Train the received model; reply with it, Z_i and the gradient at the received biases."""
    model = node.received_model(request)
    gradient = bias_gradient(node, model)
    loss = node.fit(model, node.cfg.local_epochs)
    z = representation(node, model)
    metrics = {"num-examples": len(node.data.x_train), "train-loss": loss}
    side = {Z: z, BIAS_GRAD: gradient}
    if node.cfg.secure_aggregation != "none":  # the model goes masked (client/secure.py); M in the clear
        side[M] = flat_biases(model.state_dict(), bias_names(model))
    return protocol.content(ArrayRecord(model.state_dict()), metrics=metrics, side=ArrayRecord(side))


def represent(node: Node, request: Request) -> RecordDict:
    """Z under the received model, for a node the server has no representation of."""
    z = representation(node, node.received_model(request))
    return protocol.content(metrics={"num-examples": len(node.data.x_train)}, side=ArrayRecord({Z: z}))
