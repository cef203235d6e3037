"""FedAvg's and FedAvg+'s client half: train the received model; test it, under FedAvg+ after
fine-tuning a copy on the train split."""

from __future__ import annotations

import copy

from flwr.app import RecordDict

from florist.algorithms.fedavg.spec import Finetune
from florist.client.node import Node, Request
from florist.common import protocol, training


def train(node: Node, request: Request) -> RecordDict:
    """Train the received model on the local train split; reply with the new weights."""
    model = node.received_model(request)
    loss = node.fit(model, node.cfg.local_epochs)
    return protocol.content(
        protocol.to_record(model), metrics={"num-examples": len(node.data.x_train), "train-loss": loss}
    )


def evaluate(node: Node, request: Request) -> RecordDict:
    """Test the received model. Under FedAvg+ fine-tune a copy on the train split first, and
    report the untouched global model's accuracy beside it."""
    model = node.received_model(request)
    finetune = node.cfg.settings
    if not (isinstance(finetune, Finetune) and finetune.epochs > 0):
        return node.test_reply(model)
    d = node.data
    _, global_accuracy = training.evaluate(model, d.x_test, d.y_test)
    tuned = copy.deepcopy(model)
    node.fit(tuned, finetune.epochs, lr=finetune.lr, salt=1)
    return node.test_reply(tuned, **{"global-accuracy": global_accuracy})
