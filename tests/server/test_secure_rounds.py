"""Secure aggregation wired into FedAvg's round (docs/secure-aggregation.md), in process: the global
model after a secure round is the plain weighted mean of the nodes' trained models within the
quantization bound; nothing the server receives equals or correlates with a node's update; a node
that dies between sharing its keys and its masked upload leaves the round to the others, and
below the threshold the round stops in one line, resumable; accuracy is what the plain run gets;
every combination it does not cover is one line, exit 2, before the run."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from flwr.app import Context, Message

from florist.apps.client import build_client_app
from florist.common import privacy
from florist.common import secagg_records as records
from florist.common.secagg import HEADER
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.server.exchange import Exchanger
from florist.strategies.fedattn.server import FedAttn
from florist.strategies.fedavg.server import FedAvg

NODES, CLIP, BITS = 4, 1.0, 22  # secagg-clip and secagg-bits: the defaults


def config(tmp_path, **extra) -> RunConfig:
    values = {"num-server-rounds": 2, "unseen-fraction": 0.0, "min-nodes": NODES}  # unequal sizes: dirichlet:0.3
    return RunConfig.from_mapping(values | {"results-dir": str(tmp_path)} | extra)


def flat(state) -> np.ndarray:
    """A model state's floating tensors as one float64 vector, in key order (as nodes mask them)."""
    return np.concatenate([state[k].double().numpy().ravel() for k in sorted(state) if state[k].is_floating_point()])


def watched_run(tmp_path, monkeypatch, client_app=None, server=FedAvg, **extra):
    """A run with every reply the server receives (round, message type, node, content) and the
    global model after each round (`server`: the server half whose rounds to watch): (results,
    received, models)."""
    received, models = [], {}
    trip, train = Exchanger.round_trip, server.train_round

    def spy(self, requests, message_type, server_round, expect=None):
        replies = trip(self, requests, message_type, server_round, expect)
        received.extend((server_round, message_type, node, content) for node, content in replies.items())
        return replies

    def keep(self, server_round, nodes):
        loss = train(self, server_round, nodes)
        models[server_round] = {k: t.clone() for k, t in self.model.state_dict().items()}
        return loss

    monkeypatch.setattr(Exchanger, "round_trip", spy)
    monkeypatch.setattr(server, "train_round", keep)
    results = run_in_process(config(tmp_path, **extra), NODES, client_app=client_app)
    return results, received, models


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The plain run's round 1: the model sent, and each node's update and weight, by node id."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        results, received, models = watched_run(tmp_path_factory.mktemp("plain"), monkeypatch)
    sent = FedAvg(config("unused"), None, (1, 8, 8), NODES).model.state_dict()  # round 1 sends the seeded model
    trained = {node: c for r, t, node, c in received if (r, t) == (1, "train")}
    updates = {n: flat(c.array_records["arrays"].to_torch_state_dict()) - flat(sent) for n, c in trained.items()}
    weights = {n: c.metric_records["metrics"]["num-examples"] for n, c in trained.items()}
    return results, updates, weights, flat(sent), models


def weighted_mean(updates, weights, nodes):
    return sum(weights[n] * updates[n] for n in nodes) / sum(weights[n] for n in nodes)


def bound(weights, nodes) -> float:
    """The quantization bound of docs/secure-aggregation.md, 3·n·c / (2^b · Σ w/W), W the largest weight
    (each node's weight W/2^b-rounded), plus float32's rounding of the model it lands in."""
    most = max(weights.values())
    return 3 * len(nodes) * CLIP / (2**BITS * sum(weights[n] / most for n in nodes)) + 1e-6


def test_seeded_nodes_train_the_same_update_twice(plain, tmp_path, monkeypatch):
    """The premise of the comparisons below: the same seeded round gives the same models."""
    results, _, models = watched_run(tmp_path, monkeypatch)
    assert all(torch.equal(models[1][k], plain[4][1][k]) for k in models[1])


def test_a_secure_round_loads_the_plain_weighted_mean_within_the_quantization_bound(plain, tmp_path, monkeypatch):
    _, updates, weights, sent, _ = plain
    results, _, models = watched_run(tmp_path, monkeypatch, **{"secure-aggregation": "secaggplus"})
    exact, most = weighted_mean(updates, weights, updates), bound(weights, updates)
    got = flat(models[1]) - sent
    assert np.abs(got - exact).max() <= most
    # the bound tells the weighted mean from the unweighted one: a round that ignored the weights fails
    assert np.abs(np.mean(list(updates.values()), axis=0) - exact).max() > 10 * most
    row = results["rounds"][0]
    assert (row["secagg_survivors"], row["secagg_dropped"], row["secagg_clipped"]) == (NODES, [], 0)
    stages = [e["type"] for e in row["exchanges"]]
    assert stages[:4] == ["query.secagg_keys", "query.secagg_shares", "train.secagg", "query.secagg_unmask"]


def test_nothing_the_server_receives_in_a_secure_run_equals_or_correlates_with_a_nodes_update(
    plain, tmp_path, monkeypatch
):
    _, updates, weights, _, _ = plain
    results, received, _ = watched_run(tmp_path, monkeypatch, **{"secure-aggregation": "secaggplus"})
    assert results["complete"]
    arrays = [(t, a) for _, t, _, c in received for rec in c.array_records.values() for a in rec.values()]
    assert arrays and {t for t, _ in arrays} == {"train.secagg"}  # no model in the clear, ever
    size = len(next(iter(updates.values())))
    for _, array in arrays:
        vector = array.numpy()
        assert vector.dtype == np.uint32 and vector.shape == (HEADER + size + len(records.tail("none")),)
        payload = vector[HEADER : HEADER + size].astype(np.float64)
        for update in updates.values():
            assert not np.array_equal(payload, update)
            assert abs(np.corrcoef(payload, update)[0, 1]) < 0.05
    secure = [c for _, t, _, c in received if t.startswith(("train.secagg", "query.secagg"))]
    assert all(dict(c.metric_records["metrics"]) == {} for c in secure)  # no weight, no loss per node


def dies_at(message_type: str, partitions: set[int], from_round: int = 1):
    """A mod: nodes of `partitions` raise on `message_type` from `from_round` on (after sharing their
    keys, for train.secagg)."""

    def mod(msg: Message, context: Context, call_next):
        late = int(msg.metadata.group_id) >= from_round and context.node_config["partition-id"] in partitions
        if msg.metadata.message_type == message_type and late:
            raise RuntimeError("the node died")
        return call_next(msg, context)

    return mod


def test_a_node_that_dies_before_its_masked_upload_leaves_the_round_to_the_others(plain, tmp_path, monkeypatch):
    _, updates, weights, sent, _ = plain
    app = build_client_app([dies_at("train.secagg", {1})])
    results, _, models = watched_run(tmp_path, monkeypatch, app, **{"secure-aggregation": "secaggplus"})
    assert results["complete"]
    row = results["rounds"][0]
    assert (row["secagg_survivors"], row["secagg_dropped"]) == (NODES - 1, ["partition-1"])
    others = sorted(updates)[:1] + sorted(updates)[2:]  # node ids follow the partitions
    exact = weighted_mean(updates, weights, others)
    assert np.abs(flat(models[1]) - sent - exact).max() <= bound(weights, others)


def test_below_the_threshold_the_round_stops_in_one_line_and_the_run_resumes(tmp_path):
    secure = {"secure-aggregation": "secaggplus"}
    with pytest.raises(RuntimeError) as stopped:
        app = build_client_app([dies_at("train.secagg", {1, 2}, from_round=2)])
        run_in_process(config(tmp_path, **secure), NODES, client_app=app)
    line = str(stopped.value)
    assert "\n" not in line and line.startswith(
        "round 2: secure aggregation stopped at 'collect masked vectors': 2 node(s) remain, the threshold is 3."
    )
    assert f"rounds 1-1 are kept in {tmp_path}: continue it with --resume {tmp_path}" in line
    kept = json.loads((tmp_path / "results.json").read_text())
    assert not kept["complete"] and [r["round"] for r in kept["rounds"]] == [1]
    resumed = run_in_process(config(tmp_path, **secure, **{"resume-from": str(tmp_path)}), NODES)
    assert resumed["complete"] and [r["round"] for r in resumed["rounds"]] == [1, 2]


def test_accuracy_with_secure_aggregation_is_within_half_a_point_of_the_plain_run(tmp_path):
    values = {"num-server-rounds": 3, "partition": "dirichlet:0.5", "unseen-fraction": 0.0, "min-nodes": 5}
    runs = {}
    for mode in ("none", "secaggplus"):
        cfg = RunConfig.from_mapping(values | {"results-dir": str(tmp_path / mode), "secure-aggregation": mode})
        runs[mode] = run_in_process(cfg, 5)
    accuracy = {mode: np.mean([c["accuracy"] for c in r["clients"]]) for mode, r in runs.items()}
    assert accuracy["none"] > 0.3  # trained: a comparison of two untrained models would say nothing
    assert abs(accuracy["secaggplus"] - accuracy["none"]) <= 0.005, accuracy


REFUSED = {
    "uncovered strategy": (["--strategy", "pefll"], "strategy 'pefll' is not covered"),
    "robust rule": (['aggregation="median"'], 'needs aggregation = "mean" and no clip-norm'),
    "clip-norm": (["clip-norm=1.0"], "the server never sees an update to clip"),
    "unknown mode": (['secure-aggregation="secagg"'], "secure-aggregation must be one of none, secaggplus"),
    "bits": (["secagg-bits=31"], "secagg-bits must be in [1, 30]"),
    "a threshold no round can meet": (["secagg-threshold=40"], "threshold"),  # before the run, not at round 1
    "bits a round's sum overflows": (["secagg-bits=30"], "overflow the 2^32 field"),
    "key without it": (
        ['secure-aggregation="none" secagg-clip=2.0'],
        'act only with secure-aggregation = "secaggplus"',
    ),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_what_secure_aggregation_does_not_cover_is_one_line_and_exit_2_before_the_run(case, refuses_in_one_line):
    args, expected = REFUSED[case]
    on = 'secure-aggregation="secaggplus" '
    if args[0] == "--strategy":
        args = [*args, "--run-config", on]
    else:
        args = ["--run-config", args[0] if args[0].startswith("secure-aggregation") else on + args[0]]
    refuses_in_one_line(args, expected)


def test_central_dp_under_secure_aggregation_reports_epsilon(tmp_path):
    extra = {"secure-aggregation": "secaggplus", "dp": "central", "dp-epsilon": 3.0, "dp-clip": 0.5}
    results = run_in_process(config(tmp_path, **extra), NODES)
    spent = [r["dp_epsilon"] for r in results["rounds"]]
    assert results["complete"] and spent[-1] == pytest.approx(3, rel=1e-3)
    assert all(r["secagg_survivors"] == NODES for r in results["rounds"])


def lies_at(message_type: str, partition: int):
    """A mod: node `partition` answers `message_type` with its SecAgg ids changed (claiming another
    node's keys or shares)."""

    def mod(msg: Message, context: Context, call_next):
        reply = call_next(msg, context)
        if msg.metadata.message_type == message_type and context.node_config["partition-id"] == partition:
            record = reply.content.config_records["secagg"]
            record["ids"] = [i + 1 for i in record["ids"]]
        return reply

    return mod


@pytest.mark.parametrize("stage", ["query.secagg_keys", "query.secagg_shares"])
def test_a_node_whose_secagg_reply_is_malformed_is_left_out_and_the_round_goes_on(stage, tmp_path):
    app = build_client_app([lies_at(stage, 2)])
    results = run_in_process(config(tmp_path, **{"secure-aggregation": "secaggplus"}), NODES, client_app=app)
    assert results["complete"] and all(r["secagg_survivors"] == NODES - 1 for r in results["rounds"])
    assert {(f["message_type"], f["node"].endswith("(partition-2)")) for f in results["failures"]} == {(stage, True)}


@pytest.mark.parametrize("secure", ["secaggplus", "none"])
def test_under_dp_a_node_whose_training_diverges_sends_no_change_and_is_counted(secure, tmp_path, monkeypatch):
    """TFF's zeroing: at lr 1e9 every node's training diverges; under dp each sends a zero update
    (within dp-clip) instead of failing, so the rounds complete, the model moves by the noise
    alone (σ tiny here) and every round counts its zeroed nodes in the clear; masked, the count
    (an un-noised sum) is not sent (`test_under_dp_a_masked_vector_carries_the_update_alone`)."""
    extra = {"secure-aggregation": secure, "dp": "central", "dp-noise-multiplier": 1e-6, "lr": 1e9}
    results, _, models = watched_run(tmp_path, monkeypatch, **extra)
    zeroed = [r.get("dp_zeroed") for r in results["rounds"]]
    assert results["complete"] and zeroed == ([NODES, NODES] if secure == "none" else [None, None])
    assert np.abs(flat(models[2]) - flat(models[1])).max() < 1e-5


def test_under_dp_a_masked_vector_carries_the_update_alone(plain, tmp_path, monkeypatch):
    """Issue 51: the exact sums of train losses and of clipped and diverged flags are data-dependent and
    un-noised; under dp the masked tail is empty and the clipped count 0 (the results say no train
    loss, no counts)."""
    size = len(next(iter(plain[1].values())))
    extra = {"secure-aggregation": "secaggplus", "dp": "distributed", "dp-noise-multiplier": 1.0, "dp-clip": 0.5}
    results, received, _ = watched_run(tmp_path, monkeypatch, **extra)
    vectors = [c.array_records["secagg"]["masked"].numpy() for _, t, _, c in received if t == "train.secagg"]
    assert len(vectors) == 2 * NODES and {v.shape for v in vectors} == {(HEADER + size,)}
    assert all(r["train_loss"] is None and {"dp_clipped", "secagg_clipped"}.isdisjoint(r) for r in results["rounds"])


def test_distributed_dp_nodes_noise_their_shares_so_the_unmasked_sum_carries_central_noise(tmp_path, monkeypatch):
    """dp = "distributed": nodes barely train (lr 1e-12), so a round moves the model by the noise
    the nodes added before masking alone: each N(0, (σC)²/(t − 1)), t = 3 of 4, all 4 surviving,
    summed and divided by the m = 4 sampled: std σC·√(4/2)/4, central's σC/m with any one node's
    share left out, and more."""
    sigma, clip = 2.0, 0.5
    extra = {"secure-aggregation": "secaggplus", "dp": "distributed", "dp-noise-multiplier": sigma, "dp-clip": clip}
    results, _, models = watched_run(tmp_path, monkeypatch, lr=1e-12, **extra)
    assert results["complete"] and all(r["secagg_survivors"] == NODES for r in results["rounds"])
    moved = flat(models[2]) - flat(models[1])
    assert moved.size > 50_000 and moved.std() == pytest.approx(sigma * clip * (NODES / 2) ** 0.5 / NODES, rel=0.03)
    last = results["rounds"][-1]
    assert last["dp_epsilon"] == pytest.approx(privacy.tightest(((1.0, sigma),) * 2, 1e-5)[0])
    assert last["dp_relation"] == "zero-out" and 1e-5 < last["dp_delta"] < 2e-5  # a share clipped: into δ


def test_fedattn_under_secure_aggregation_keeps_the_plain_model_with_only_g_masked(tmp_path, monkeypatch):
    """FedAttn with attention from round 2 (each node then trains from its own biases M̃_i): the
    masked round's global model stays within quantization's reach of the plain run's, biases too
    (M̄ is the mean of the clear M_i, not the model sent plus the masked mean of M_i − M̃_i, off by
    0.07), and the model goes up only masked; Z, M and the gradient in the clear."""
    extra = {"strategy": "fedattn", "fedattn-warmup": 1, "fedattn-k": 2}
    with pytest.MonkeyPatch.context() as first:  # its own patches: a second watcher would wrap the first
        _, _, plain = watched_run(tmp_path / "plain", first, server=FedAttn, **extra)
    results, received, secure = watched_run(
        tmp_path / "secure", monkeypatch, server=FedAttn, **extra, **{"secure-aggregation": "secaggplus"}
    )
    assert results["complete"] and all(r["secagg_survivors"] == NODES for r in results["rounds"])
    # Quantization rounds at random (up to 3e-4 apart by round 2, the attention having stepped on it),
    # far below the 0.07 of an M̄ made from the masked mean; later rounds part further by Adam's steps.
    assert np.abs(flat(secure[1]) - flat(plain[1])).max() < 1e-5
    assert np.abs(flat(secure[2]) - flat(plain[2])).max() < 2e-3
    trained = [c for _, t, _, c in received if t == "train.secagg"]
    assert trained and all(set(c.array_records) == {"secagg", "side"} for c in trained)
    assert all(set(c.array_records["side"]) == {"z", "bias-grad", "m"} for c in trained)


def test_a_distributed_dp_node_refuses_a_noise_multiplier_below_what_its_own_settings_need(tmp_path, caplog):
    """σ for ε = 3 over 2 rounds at q = 1 (the server picks the sample: no amplification against
    it); a server asking for half of it is refused by every node, so the round stops, one line."""
    extra = {"secure-aggregation": "secaggplus", "dp": "distributed", "dp-epsilon": 3.0}
    cfg = config(tmp_path, **extra)
    real = FedAvg.train_securely

    def stingy(self, *args, **kwargs):
        self.privacy = dataclasses.replace(self.privacy, sigma=self.privacy.sigma / 2)
        return real(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FedAvg, "train_securely", stingy)
        with pytest.raises(RuntimeError, match="0 node"):
            run_in_process(cfg, NODES)
    refused = [r.getMessage() for r in caplog.records if "left out of train.secagg" in r.getMessage()]
    assert len(refused) == NODES and all("below the" in m for m in refused)
