"""A node's side of secure aggregation (`secure-aggregation = "secaggplus"`,
docs/secure-aggregation.md), what the handlers of its four exchanges (FedAvg's client half) share:
the node's secrets between the messages, and the masked update that replaces a trained model.

The secrets live in the node's run state (`NodeState.remember`: Flower's context state, which the
SuperNode keeps whichever process answers the next message), tagged with the round, so that a
message of another round never meets them. The training stage trains as the strategy's own handler
does, then sends, in place of the model, its update (trained minus sent, every floating tensor,
flattened in key order) masked, with the train loss behind it unless under dp: the server learns
the weighted mean of both, nothing of one node."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
from flwr.app import RecordDict

from florist.client import ledger
from florist.client.node import Node, Request
from florist.common import privacy, protocol, secagg
from florist.common import secagg_records as records

STATE = "secagg"  # the node's run state of the round in progress


def mask_trained(node: Node, request: Request, reply: RecordDict) -> RecordDict:
    """The `train.secagg` reply for a training handler's `reply` to `request`: this round's shares
    from the others kept, and, in place of the trained model, its update masked (`masked_update`);
    what the handler sends beside the model (`side`: FedAttn's Z, M and gradient) goes as it is."""
    state = recall(node)
    ciphertexts, commitments = records.routed_of(request.content, f"node {node.key}: the server's shares")
    sigma = records.noise_of(request.content, f"node {node.key}: the server's train request")
    sent = node.received_model(request).state_dict()
    # The node's own model, unchecked against MAX_MAGNITUDE: whatever it holds, the update is clipped
    # (dp-clip, or each value to secagg-clip) before it leaves; a non-finite value is refused by node_mask.
    trained = reply.array_records[protocol.ARRAYS].to_torch_state_dict()
    metrics = reply.metric_records[protocol.METRICS]
    # under dp the reply carries no train loss (`local`) and the masked vector no tail: 0 when absent
    loss = float(metrics.get("train-loss", 0.0)) * state.setup.clip / records.LOSS_RANGE
    vector, weight = masked_update(node, sent, trained, loss, metrics["num-examples"])
    if node.cfg.user_dp == "distributed":  # no tail under dp: every value is the update's
        vector = distributed_release(node, vector, sigma, state.setup.threshold)
    weight = min(weight, state.setup.max_weight)
    state, masked, _ = secagg.node_mask(state, ciphertexts, vector, weight, commitments, node.cfg.user_dp == "none")
    keep(node, state)
    content = protocol.content(metrics={}, side=reply.array_records.get(protocol.SIDE))
    content[records.SECAGG] = records.masked_record(masked)
    content[records.REPORTED] = records.reported_record(list(state.reported))
    return content


def masked_update(
    node: Node, sent: Mapping, trained: Mapping, loss: float, examples: float
) -> tuple[np.ndarray, float]:
    """(what the node masks, its weight): the update as one float64 vector with records.tail
    behind it (the scaled train `loss`, without dp only). Under
    `dp = "central"` or `"distributed"` the node clips its own update to dp-clip (the server never
    sees it), and under any `dp` every node weighs 1, as DP-FedAvg's sensitivity needs; otherwise
    its example count, at most its train split (the num-train it reported at discovery, the
    server's cap in the clear: kNN-Per's phase 2 also trains on validation) and, by the caller, at
    most max-weight."""
    delta = privacy.update(trained, sent)
    if node.cfg.user_dp in ("central", "distributed"):
        delta, _ = privacy.clip(delta, node.cfg.user_level().dp_clip)
    weight = 1.0 if node.cfg.user_dp != "none" else float(min(examples, len(node.data.x_train)))  # as discovery said
    tail = [loss] * len(records.tail(node.cfg.dp))
    return np.concatenate([records.flatten(delta), tail]), weight


def distributed_release(node: Node, vector: np.ndarray, sigma: float, threshold: int) -> np.ndarray:
    """`dp = "distributed"`: `vector` with this node's share of central's noise on the update's
    values, N(0, (σC)²/(t − 1)) each (privacy.share_std), σ as the server sent it and t the
    threshold this node checked at setup, drawn before masking: the server never holds an
    un-noised update sum. The node refuses a σ below its own (florist/client/ledger.py: its
    dp-epsilon over its own dp-releases when its --node-config sets dp, never the server's
    num-server-rounds), and draws once per (run, round), counted in its ledger: a restarted
    secure round masks the same noised vector again."""
    book = ledger.Ledger(node)
    if not sigma >= book.plan.sigma * (1 - 1e-6):
        raise ValueError(
            f'node {node.key}: dp = "distributed": the server asks for noise σ = {sigma:.4g}, below the '
            f"{book.plan.sigma:.4g} its dp settings need: refusing to train"
        )
    book.plan = dataclasses.replace(book.plan, sigma=sigma)  # what it draws with, and counts

    def draw(plan: privacy.Plan) -> dict[str, np.ndarray]:
        rng = privacy.noise_generator(node.cfg.dp_noise_seed, node.server_round, privacy.node_word(node.key))
        return {"vector": vector + rng.normal(0.0, privacy.share_std(plan.sigma, plan.clip, threshold), len(vector))}

    return book.release(draw)["vector"]


def keep(node: Node, state: secagg.NodeState) -> None:
    """Keep this node's secrets of the round in progress until its next message."""
    node.state.remember(STATE, {}, round=node.server_round, **state.to_record())


def recall(node: Node) -> secagg.NodeState:
    """This round's state (each `node_*` function checks it is at the stage before its own)."""
    kept = node.state.recall(STATE)
    if kept is None or kept[1].get("round") != node.server_round:
        raise ValueError(f"node {node.key}: no secure-aggregation state of round {node.server_round}: refusing")
    return secagg.NodeState.from_record(kept[1])
