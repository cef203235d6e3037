"""A hostile node under secure aggregation (issue 51), against florist's real ClientApp and
ServerApp: what it adds to its masked vector comes out of the unmasked sum, so a sum no honest
survivors can make stops the round in one line with the model as it was, never aggregated; shares
that do not open drop their sender alone, on the others' reports; a wrong share revealed at unmask
names its sender, who trains no more in the run, resumed or not."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from flwr.app import Array, Context, Message

from florist.apps.client import build_client_app
from florist.common import secagg_records as records
from florist.common.secagg import MODULUS
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process

NODES, BITS = 4, 22


def config(tmp_path, **extra) -> RunConfig:
    values = {"num-server-rounds": 2, "unseen-fraction": 0.0, "min-nodes": NODES, "secure-aggregation": "secaggplus"}
    return RunConfig.from_mapping(values | {"results-dir": str(tmp_path)} | extra)


def shifts(partition: int, at: slice, amount: int, from_round: int = 2):
    """A mod: node `partition` adds `amount` (mod 2^32) to the values `at` of its masked vector from
    `from_round` on: the masks hide the change as they hide the update."""

    def mod(msg: Message, context: Context, call_next):
        reply = call_next(msg, context)
        late = int(msg.metadata.group_id) >= from_round and context.node_config["partition-id"] == partition
        if msg.metadata.message_type == "train.secagg" and late:
            vector = reply.content.array_records[records.SECAGG][records.MASKED].numpy().astype(np.int64)
            vector[at] += amount
            reply.content.array_records[records.SECAGG][records.MASKED] = Array(
                np.mod(vector, MODULUS).astype(np.uint32)
            )
        return reply

    return mod


ATTACKS = {
    # the weight slot made 1 step: the server divides the clipped sum by 2^-22 and central dp's noise vanishes
    "weight header under central dp": (
        {"dp": "central", "dp-noise-multiplier": 1.0, "dp-clip": 0.5},
        slice(0, 1),
        1 - NODES * 2**BITS,
        "the unmasked weight sum is 1 step(s) where the 4 survivors' weights make 16777216",
    ),
    # half the field on every value: each global weight moves by 2^31 steps of 2c/2^b
    "2^31 on every value": ({}, slice(2, None), 2**31, "value(s) lie beyond the 4 survivors' range [0, 16777216]"),
}


@pytest.mark.parametrize("attack", ATTACKS, ids=list(ATTACKS))
def test_a_node_that_alters_its_masked_vector_stops_the_round_in_one_line_with_the_model_unchanged(attack, tmp_path):
    extra, at, amount, expected = ATTACKS[attack]
    app = build_client_app([shifts(1, at, amount)])
    with pytest.raises(RuntimeError) as stopped:
        run_in_process(config(tmp_path, **extra), NODES, client_app=app)
    line = str(stopped.value)
    assert "\n" not in line and line.startswith("round 2: secure aggregation: ") and expected in line
    assert "nothing is aggregated" in line and f"--resume {tmp_path}" in line
    kept = json.loads((tmp_path / "results.json").read_text())  # round 1 checkpointed, round 2 never
    assert not kept["complete"] and [r["round"] for r in kept["rounds"]] == [1]


def garbles_shares(partition: int):
    """A mod: node `partition` sends random bytes in place of every ciphertext at share keys."""

    def mod(msg: Message, context: Context, call_next):
        reply = call_next(msg, context)
        if msg.metadata.message_type == "query.secagg_shares" and context.node_config["partition-id"] == partition:
            record = reply.content.config_records[records.SECAGG]
            record["values"] = [os.urandom(len(v)) for v in record["values"]]
        return reply

    return mod


def test_a_node_whose_shares_do_not_open_is_dropped_by_the_others_report_and_each_round_completes(tmp_path):
    """Random ciphertexts made every honest node refuse to mask ("1 node(s) remain"), every round:
    each now reports the sender, who alone is dropped."""
    app = build_client_app([garbles_shares(2)])
    results = run_in_process(config(tmp_path), NODES, client_app=app)
    assert results["complete"]
    rows = [(r["secagg_survivors"], r["secagg_dropped"], r["secagg_reported"]) for r in results["rounds"]]
    assert rows == [(NODES - 1, ["partition-2"], ["partition-2"])] * 2
    named = {(f["message_type"], f["node"].endswith("(partition-2)")) for f in results["failures"]}
    assert named == {("query.secagg_shares", True)}


def reveals_wrong_shares(partition: int):
    """A mod: node `partition` flips a bit of every share it reveals at unmask."""

    def mod(msg: Message, context: Context, call_next):
        reply = call_next(msg, context)
        if msg.metadata.message_type == "query.secagg_unmask" and context.node_config["partition-id"] == partition:
            record = reply.content.config_records[records.SECAGG]
            record["values"] = [v[:-1] + bytes([v[-1] ^ 1]) for v in record["values"]]
        return reply

    return mod


def dies_in_round_2(partitions: set[int]):
    """A mod: nodes of `partitions` fail round 2's masked upload (so that the run stops there)."""

    def mod(msg: Message, context: Context, call_next):
        late = int(msg.metadata.group_id) == 2 and context.node_config["partition-id"] in partitions
        if msg.metadata.message_type == "train.secagg" and late:
            raise RuntimeError("the node died")
        return call_next(msg, context)

    return mod


def test_a_node_that_reveals_wrong_shares_is_named_and_left_out_of_later_rounds_and_of_a_resumed_run(tmp_path):
    """Wrong Shamir shares at unmask stopped the run, on every resume: the owners' commitments now
    name the sender; its round completes without its shares, and it trains no more, resumed or not."""
    app = build_client_app([reveals_wrong_shares(2), dies_in_round_2({1, 3})])
    with pytest.raises(RuntimeError, match="round 2: secure aggregation stopped"):
        run_in_process(config(tmp_path), NODES, client_app=app)
    kept = json.loads((tmp_path / "results.json").read_text())["rounds"]
    assert [(r["secagg_survivors"], r["secagg_cheaters"]) for r in kept] == [(NODES, ["partition-2"])]
    failures = json.loads((tmp_path / "results.json").read_text())["failures"]
    assert any(f["message_type"] == "query.secagg_unmask" and "commitments" in f["reason"] for f in failures)
    resumed = run_in_process(config(tmp_path, **{"resume-from": str(tmp_path)}), NODES)  # honest from here on
    assert resumed["complete"] and [r["secagg_survivors"] for r in resumed["rounds"]] == [NODES, NODES - 1]
    assert resumed["rounds"][1]["secagg_dropped"] == []  # partition-2 not asked at all
