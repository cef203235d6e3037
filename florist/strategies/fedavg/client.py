"""FedAvg's and FedAvg+'s client half: train the received model (under `dp = "local"`, clip and
noise the update before it leaves: florist/common/privacy.py); test it, under FedAvg+ after
fine-tuning a copy on the train split. Under `secure-aggregation`, answer its four stages
(florist/common/secagg.py's `node_*` functions, the state between them in florist/client/secure.py)."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping

from flwr.app import RecordDict

from florist.client import secure
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
    model's loss on the whole train split before training: q-FFL's F_k(w^t), what QFedAvg reads."""
    model, d, mu = node.received_model(request), node.data, node.cfg.proximal_mu
    metrics = {"num-examples": len(d.x_train)}
    if request.from_flower and d.labelled:  # unlabelled: `fit` says so
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
    if node.cfg.dp == "local":
        model.load_state_dict(local_dp(node, start, model.state_dict()))
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
    loss = training.evaluate(model, node.data.x_train, node.data.y_train, node.device)[0]
    return {"train-loss": loss if math.isfinite(loss) and loss < LOSS_CAP else LOSS_CAP, "dp-zeroed": 1}


def local_dp(node: Node, start: dict, trained: dict) -> dict:
    """`trained` as the node sends it under `dp = "local"`: its update clipped to dp-clip and
    noised with the σ that spends dp-epsilon over num-server-rounds rounds of this node's
    (q = 1: its own data, every round it takes part in), or dp-noise-multiplier. The node counts
    the rounds it noised in this run (its state folder: a resumed run's too) and trains no more
    once another would spend more than dp-epsilon, whatever num-server-rounds the server said."""
    plan = privacy.Plan.of(node.cfg)
    name = f"local-dp-rounds-{node.run_id}"
    rounds = sorted({*(node.state.load_json(name) or []), node.server_round})
    if math.isfinite(plan.cap) and plan.spent(len(rounds)) > plan.cap * (1 + 1e-9):
        raise ValueError(
            f"node {node.key}: local dp: round {node.server_round} would spend ε = {plan.spent(len(rounds)):.3g} "
            f"> its dp-epsilon {plan.cap:g} ({len(rounds) - 1} rounds noised); it trains no more in this run"
        )
    node.state.save_json(name, rounds)
    rng = privacy.noise_generator(node.cfg.dp_noise_seed, node.server_round, privacy.node_word(node.key))
    return privacy.local_update(start, trained, plan, rng)


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
    node.fit(tuned, finetune.epochs, lr=finetune.lr, salt=1)
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
