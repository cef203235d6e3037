"""Local's client half: each client trains only its own model, which lives for the run (a
client that never trained, unseen or never sampled, trains one from scratch when tested)."""

from __future__ import annotations

from flwr.app import RecordDict

from florist.client.node import Node, Request
from florist.common import protocol
from florist.common.models import Net

MODEL = "model"


def _own_model(node: Node) -> tuple[Net, bool]:
    """The node's model of this run, and whether it had one."""
    model, kept = node.new_model(), node.state.recall(MODEL)
    if kept is not None:
        model.load_state_dict(kept[0])
    return model, kept is not None


def train(node: Node, request: Request) -> RecordDict:
    """One round of local training; the model stays on the node."""
    model, _ = _own_model(node)
    loss = node.fit(model, node.cfg.local_epochs)
    node.state.remember(MODEL, model.state_dict())
    return protocol.content(metrics={"num-examples": len(node.data.x_train), "train-loss": loss})


def evaluate(node: Node, request: Request) -> RecordDict:
    """Test the node's own model, training one first (`scratch-epochs`) if it has none."""
    model, trained = _own_model(node)
    if not trained:
        node.fit(model, request.settings.scratch_epochs)
        node.state.remember(MODEL, model.state_dict())
    return node.test_reply(model)
