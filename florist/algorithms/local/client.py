"""Client half of the Local baseline: each client trains only its own model.

The model lives in `context.state` (it must survive across the rounds of one run, not
beyond). A client that never trained (unseen, or never sampled) trains from scratch for
the same budget when it is evaluated.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, RecordDict

from florist.client.node import Node
from florist.common import protocol
from florist.common.models import Net

STATE_KEY = "local-model"


def _own_model(node: Node, state: RecordDict) -> Net:
    model = node.new_model()
    if STATE_KEY in state.array_records:
        model.load_state_dict(state.array_records[STATE_KEY].to_torch_state_dict())
    return model


def train(node: Node, state: RecordDict) -> RecordDict:
    """One round of local training; the model stays on the node."""
    model = _own_model(node, state)
    loss = node.fit(model, node.cfg.local_epochs)
    state.array_records[STATE_KEY] = ArrayRecord(model.state_dict())
    return protocol.content(metrics={"num-examples": len(node.data.x_train), "train-loss": loss})


def evaluate(node: Node, state: RecordDict, content: RecordDict) -> RecordDict:
    """Test the node's own model, training one first (`scratch-epochs`) if it has none."""
    model = _own_model(node, state)
    if STATE_KEY not in state.array_records:
        config = content.config_records.get(protocol.CONFIG, {})
        node.fit(model, int(config.get("scratch-epochs", node.cfg.local_epochs)))
        state.array_records[STATE_KEY] = ArrayRecord(model.state_dict())
    return node.test_reply(model)
