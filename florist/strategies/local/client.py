"""Local's client half: each client trains only its own model, kept in its state folder for
the run (a client that never trained, unseen or never sampled, trains one from scratch when
tested)."""

from __future__ import annotations

import torch
from flwr.app import RecordDict

from florist.client.node import Node, Request
from florist.common import protocol
from florist.common.models import Net

MODEL = "model"


def _own_model(node: Node, up_to: int) -> tuple[Net, bool]:
    """The node's model of this run as of round `up_to`, and whether it had one."""
    model, kept = node.new_model(), node.state.load_round(MODEL, node.run_id, up_to)
    if kept is not None:
        model.load_state_dict({k: torch.from_numpy(v) for k, v in kept[0].items()})
    return model, kept is not None


def _keep(node: Node, model: Net) -> None:
    node.state.save_round(MODEL, {k: v.numpy() for k, v in model.state_dict().items()}, node.run_id, node.server_round)


def train(node: Node, request: Request) -> RecordDict:
    """One round of local training; the model stays on the node."""
    model, _ = _own_model(node, node.server_round - 1)
    loss = node.fit(model, node.cfg.local_epochs, private=False)  # never leaves the node: no DP-SGD, no ε
    _keep(node, model)
    loss_metric = {} if node.cfg.record_dp else {"train-loss": loss}  # under record-level dp nothing of the data
    return protocol.content(metrics={"num-examples": len(node.data.x_train)} | loss_metric)


def evaluate(node: Node, request: Request) -> RecordDict:
    """Test the node's own model, training one first (`scratch-epochs`) if it has none."""
    model, trained = _own_model(node, node.server_round)
    if not trained:
        node.fit(model, request.settings.scratch_epochs, private=False)
        _keep(node, model)
    return node.test_reply(model)
