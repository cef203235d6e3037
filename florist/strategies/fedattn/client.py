"""FedAttn's client half: the server sends G with biases M̃_i its attention made for this
client; the client trains the whole model as FedAvg does and returns it (G and its own new
biases M_i) with, beside it, its representation Z_i (the last hidden layer averaged over its
train split) and ∂L/∂M̃_i, the gradient of its training loss at the biases it received: the
server trains its attention through that gradient. Under secure aggregation the model's update
goes masked (FedAvg's `train.secagg`) and the new biases M_i join Z_i and the gradient in the
clear: the server's attention needs each one. The client keeps nothing.

Under record-level dp the model is DP-SGD's, and Z_i and ∂L/∂M̃_i are each one more DP-SGD step
(`private_representation`, `private_bias_gradient`): a Poisson sample of the train split at the
node's q, each record's features (or bias gradient) clipped to dp-clip, summed, noised with σ·dp-clip
and divided by batch-size, counted in the node's ledger as a step. No train loss is sent."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, RecordDict

from florist.client import ledger
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


def private_mean(node: Node, model: Net, vectors, dim: int, salt: int) -> torch.Tensor:
    """Record-level dp: one DP-SGD step's noised mean of `vectors(x, y)` (a row per record) over a Poisson
    sample of the train split, one of the steps the node's ledger reserved for this message."""
    book = ledger.record_ledger(node)
    if book.take(1) != 1:
        raise RuntimeError(f"node {node.key}: no DP-SGD step reserved for FedAttn's noised statistics")
    d, cfg = node.data, node.cfg
    sampler, noise = node.private_generators(0xFA, salt, on_cpu=True)
    targets = torch.from_numpy(np.array(d.y_train))

    def rows(batch: torch.Tensor) -> torch.Tensor:
        with training.on_device(model, node.device) as device:
            x = training.inputs(d.x_train[batch.numpy()], device)
            return vectors(model, x, targets[batch].to(device)).cpu()

    settings = {"rate": book.q, "clip": cfg.dp_clip, "sigma": book.sigma, "batch_size": cfg.batch_size}
    return training.private_mean(rows, len(d.x_train), **settings, sampler=sampler, noise=noise, dim=dim)


def private_representation(node: Node, model: Net) -> torch.Tensor:
    """Z under record-level dp: a DP-SGD step's noised mean of the records' features."""
    dim = model.head.in_features

    def features(net: Net, x: torch.Tensor, _y: torch.Tensor) -> torch.Tensor:
        net.eval()
        with torch.no_grad():
            return net.features(x)

    return private_mean(node, model, features, dim, 0)


def private_bias_gradient(node: Node, model: Net) -> torch.Tensor:
    """∂L/∂M under record-level dp: a DP-SGD step's noised mean of the records' bias gradients (eval mode)."""
    if not node.data.labelled:
        raise ValueError(f"node {node.key}: FedAttn trains on labels, but the node's data has no y")
    names, layers = bias_names(model), training.per_sample_layers(model)
    params = dict(model.named_parameters())

    def gradients(net: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        net.eval()
        grads, _ = training.per_sample_gradients(net, layers, x.to(next(net.parameters()).dtype), y)
        return torch.cat([grads[params[n]] for n in names], dim=1)

    return private_mean(node, model, gradients, sum(params[n].numel() for n in names), 1)


def train(node: Node, request: Request) -> RecordDict:
    """Train the received model; reply with it, Z_i and the gradient at the received biases."""
    model = node.received_model(request)
    if node.cfg.record_dp:
        return train_private(node, model)
    gradient = bias_gradient(node, model)
    loss = node.fit(model, node.cfg.local_epochs)
    z = representation(node, model)
    metrics = {"num-examples": len(node.data.x_train), "train-loss": loss}
    side = {Z: z, BIAS_GRAD: gradient}
    if node.cfg.secure_aggregation != "none":  # the model goes masked (client/secure.py); M in the clear
        side[M] = flat_biases(model.state_dict(), bias_names(model))
    return protocol.content(ArrayRecord(model.state_dict()), metrics=metrics, side=ArrayRecord(side))


def train_private(node: Node, model: Net) -> RecordDict:
    """`train` under record-level dp: the round's steps reserved at once (the local ones and one each for
    the gradient and Z, so σ spends dp-epsilon over rounds of all of them), fewer local ones when the
    ledger allows fewer."""
    book = ledger.record_ledger(node)
    local = node.local_steps(node.cfg.local_epochs)
    node.check_steps(local + 2)
    allowed = book.reserve(local + 2, len(node.data.x_train))
    if allowed < 3:
        raise ledger.Refused(
            f"node {node.key}: dp = record: its dp-epsilon leaves {allowed} DP-SGD step(s), and a FedAttn round needs "
            "at least 3 (its bias gradient, a local step, its representation): it trains no more"
        )
    gradient = private_bias_gradient(node, model)
    node.fit(model, node.cfg.local_epochs, steps=allowed - 2)
    z = private_representation(node, model)
    side = {Z: z, BIAS_GRAD: gradient}
    if node.cfg.secure_aggregation != "none":  # the model goes masked (client/secure.py); M in the clear
        side[M] = flat_biases(model.state_dict(), bias_names(model))
    return protocol.content(
        ArrayRecord(model.state_dict()), metrics={"num-examples": len(node.data.x_train)}, side=ArrayRecord(side)
    )


def represent(node: Node, request: Request) -> RecordDict:
    """Z under the received model, for a node the server has no representation of (under record-level
    dp one DP-SGD step's noised mean, counted in its ledger)."""
    if node.cfg.record_dp:
        model = node.received_model(request)
        ledger.record_ledger(node).reserve(1, len(node.data.x_train))
        z = private_representation(node, model)
        return protocol.content(metrics={"num-examples": len(node.data.x_train)}, side=ArrayRecord({Z: z}))
    z = representation(node, node.received_model(request))
    return protocol.content(metrics={"num-examples": len(node.data.x_train)}, side=ArrayRecord({Z: z}))
