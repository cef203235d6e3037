"""Client half of FedAvg and FedAvg+ (fine-tune before testing): Flower's standard `train`
and `evaluate` messages, so Flower's built-in strategies can drive florist clients too."""

from __future__ import annotations

import copy

from flwr.app import RecordDict

from florist.client.node import Node
from florist.common import protocol, training
from florist.common.models import Net


def received_model(node: Node, content: RecordDict) -> Net:
    """The model sent under `arrays`, checked against this run's architecture."""
    model = node.new_model()
    model.load_state_dict(protocol.arrays_of(content, model.state_dict(), f"node {node.key}: the server's message"))
    return model


def train(node: Node, content: RecordDict) -> RecordDict:
    """Train the received model on the local train split; reply with the new weights."""
    model = received_model(node, content)
    loss = node.fit(model, node.cfg.local_epochs)
    return protocol.content(
        protocol.to_record(model), metrics={"num-examples": len(node.data.x_train), "train-loss": loss}
    )


def evaluate(node: Node, content: RecordDict) -> RecordDict:
    """Test the received model. When the server asks (`finetune`, FedAvg+), fine-tune a copy
    on the train split first and report the untouched global model's accuracy beside it."""
    model = received_model(node, content)
    finetune = content.config_records.get(protocol.CONFIG, {}).get("finetune", False)
    if not (finetune and node.cfg.finetune_epochs > 0):
        return node.test_reply(model)
    d = node.data
    _, global_accuracy = training.evaluate(model, d.x_test, d.y_test)
    tuned = copy.deepcopy(model)
    node.fit(tuned, node.cfg.finetune_epochs, lr=node.cfg.finetune_lr, salt=1)
    return node.test_reply(tuned, **{"global-accuracy": global_accuracy})
