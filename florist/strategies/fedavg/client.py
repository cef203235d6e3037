"""FedAvg's and FedAvg+'s client half: train the received model (under `dp = "local"`, clip and
noise the update before it leaves: florist/common/privacy.py); test it, under FedAvg+ after
fine-tuning a copy on the train split. Under `secure-aggregation`, answer its four stages
(florist/common/secagg.py's `node_*` functions, the state between them in florist/client/secure.py)."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping

import numpy as np
import torch
from flwr.app import RecordDict

from florist.client import ledger, secure
from florist.client.node import Node, Request
from florist.common import privacy, protocol, secagg, training
from florist.common import secagg_records as records
from florist.strategies.fedavg.spec import FinetuneSettings

log = logging.getLogger("flwr").getChild(__name__)
LOSS_CAP = records.LOSS_RANGE  # a zeroed node's train loss at most this: what secure aggregation carries


def train(node: Node, request: Request) -> RecordDict:
    """Train the received model on the local train split, with FedProx's proximal term when
    `proximal-mu` > 0 (Flower's FedProx sends it); reply with the new weights and `train-loss`,
    the mean loss of the last pass. For Flower's strategies also `train_loss`, the received
    model's loss on the whole train split before training: q-FFL's F_k(w^t), what QFedAvg reads.
    Under `dp = "local"` the reply is the noised model and the example count alone (`local_dp`); under
    record-level dp the model DP-SGD trained (`Node.fit`) and the example count, no train loss."""
    model, d, mu = node.received_model(request), node.data, node.cfg.proximal_mu
    metrics = {"num-examples": len(d.x_train)}
    book = ledger.Ledger(node) if node.cfg.user_dp == "local" else None
    if book is not None and (kept := book.prior()) is not None:  # asked again: what it released, before any work
        return local_reply(model, kept, metrics)
    if request.from_flower and d.labelled and book is None and not node.cfg.record_dp:  # unlabelled: `fit` says so
        metrics["train_loss"] = training.evaluate(model, d.x_train, d.y_train, node.device)[0]
    penalty = training.proximal(model, mu) if mu > 0 else None
    start = {key: t.clone() for key, t in model.state_dict().items()} if node.cfg.dp != "none" else None
    try:
        metrics["train-loss"] = node.fit(model, node.cfg.local_epochs, penalty=penalty)
        if start is not None and not (size := largest(model.state_dict())) <= protocol.MAX_MAGNITUDE:  # or nan
            raise FloatingPointError(f"training diverged (a weight of {size:.3g}, beyond what a server takes)")
    except FloatingPointError as err:
        if start is None:
            raise
        metrics |= zeroed(node, model, start, err)
    if node.cfg.record_dp:  # the train loss is an un-noised value of the records (dp-zeroed is DP-SGD's output's)
        metrics.pop("train-loss", None)
    if book is not None:
        return local_reply(model, local_dp(node, book, start, model.state_dict()), {"num-examples": len(d.x_train)})
    return protocol.content(protocol.to_record(model), metrics=metrics)


def largest(state: Mapping) -> float:
    """The largest magnitude among a state's floating values; nan when any is nan (which `max` skips)."""
    sizes = [float(t.abs().max()) for t in state.values() if t.is_floating_point() and t.numel()]
    return math.nan if any(math.isnan(v) for v in sizes) else max(sizes, default=0.0)


def zeroed(node: Node, model, start: dict, err: FloatingPointError) -> dict[str, float]:
    """Under `dp`, a node whose training diverged (its loss, or a weight beyond
    protocol.MAX_MAGNITUDE, which a server refuses) sends no change (TFF's "zeroing" of a
    non-finite update): a zero update is within dp-clip, so the guarantee holds, and one node
    thrown off by the noise the global model carries does not end the round. It says so
    (`dp-zeroed`, which the server counts); its train loss is the received model's, at most
    LOSS_CAP (what a non-finite one reads as)."""
    model.load_state_dict(start)
    log.warning("node %s: round %s: %s; under dp it sends no change (dp-zeroed)", node.key, node.server_round, err)
    if node.cfg.record_dp:  # no train loss leaves the node
        return {"dp-zeroed": 1}
    loss = training.evaluate(model, node.data.x_train, node.data.y_train, node.device)[0]
    return {"train-loss": loss if math.isfinite(loss) and loss < LOSS_CAP else LOSS_CAP, "dp-zeroed": 1}


def local_dp(node: Node, book: ledger.Ledger, start: dict, trained: dict) -> dict[str, np.ndarray]:
    """`trained` as the node sends it under `dp = "local"`: its update clipped to dp-clip and
    noised with the ledger's σ (the node's own settings when its --node-config sets dp), drawn
    once per (run, round) and counted in the node's ledger (florist/client/ledger.py)."""
    rng = privacy.noise_generator(node.cfg.dp_noise_seed, node.server_round, privacy.node_word(node.key))
    return book.release(lambda plan: {k: t.numpy() for k, t in privacy.local_update(start, trained, plan, rng).items()})


def local_reply(model, noised: dict[str, np.ndarray], metrics: dict) -> RecordDict:
    """The `dp = "local"` training reply: the noised model and what the node's size says, no
    un-noised value of its data (no train loss, no dp-zeroed: docs/privacy.md)."""
    model.load_state_dict({key: torch.from_numpy(a) for key, a in noised.items()})
    return protocol.content(protocol.to_record(model), metrics=metrics)


def evaluate(node: Node, request: Request) -> RecordDict:
    """Test the received model. Under FedAvg+ fine-tune a copy on the train split first, and
    report the untouched global model's accuracy beside it."""
    model = node.received_model(request)
    finetune = node.cfg.settings
    if not (isinstance(finetune, FinetuneSettings) and finetune.epochs > 0):
        return node.test_reply(model)
    d = node.data
    _, global_accuracy = training.evaluate(model, d.x_test, d.y_test, node.device)
    tuned = copy.deepcopy(model)
    node.fit(tuned, finetune.epochs, lr=finetune.lr, salt=1, private=False)  # never leaves the node: no DP-SGD
    return node.test_reply(tuned, **{"global-accuracy": global_accuracy})


def secagg_keys(node: Node, request: Request) -> RecordDict:
    """Secure aggregation's setup: two fresh key pairs for this round; their public halves go up."""
    node_id, setup = records.setup_of(request.content, f"node {node.key}: the server's setup")
    state, own = secagg.node_setup(node_id, setup)
    secure.keep(node, state)
    return records.put(protocol.content(metrics={}), **records.keys_values({node_id: own}))


def secagg_shares(node: Node, request: Request) -> RecordDict:
    """Share keys: Shamir shares of this node's secrets, each other node's encrypted for it."""
    public = records.keys_of(request.content, f"node {node.key}: the server's keys")
    state, sent, commitments = secagg.node_share_keys(secure.recall(node), public)
    secure.keep(node, state)
    return records.put(
        protocol.content(metrics={}), **records.id_values(sent), **records.commitments_values(commitments)
    )


def secure_training(trainers: Mapping[str, Callable[[Node, Request], RecordDict]]) -> Callable:
    """The `train.secagg` handler: train with the run's strategy's own training handler
    (`trainers`, by strategy: kNN-Per's adds its validation split in phase 2), then mask the update."""

    def train_secagg(node: Node, request: Request) -> RecordDict:
        if node.cfg.strategy not in trainers:
            raise ValueError(f"node {node.key}: strategy {node.cfg.strategy!r} has no secure aggregation")
        return secure.mask_trained(node, request, trainers[node.cfg.strategy](node, request))

    return train_secagg


def secagg_unmask(node: Node, request: Request) -> RecordDict:
    """Unmask: this node's shares of the survivors' seeds and of the dropped nodes' mask keys."""
    survivors, dropped = records.unmask_of(request.content, f"node {node.key}: the server's unmask request")
    state, reply = secagg.node_unmask(secure.recall(node), survivors, dropped)
    secure.keep(node, state)
    return records.put(protocol.content(metrics={}), **records.id_values(reply))
