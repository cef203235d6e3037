"""A round that too few nodes answered did not happen: the run stops with one line naming the
exchange, the first failure and how to resume; it keeps the rounds before it and is not written
complete; resumed once the nodes are back, it completes (in-process federations whose nodes are
made to fail by a client mod)."""

import json

import pytest
from flwr.app import Context, Message

from florist.apps.client import build_client_app
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process


def failing(from_round: int, partitions: set[int]):
    """A mod: nodes of `partitions` raise in every train message from round `from_round` on."""

    def mod(msg: Message, context: Context, call_next):
        late = msg.metadata.message_type.startswith("train") and int(msg.metadata.group_id) >= from_round
        if late and context.node_config["partition-id"] in partitions:
            raise RuntimeError("the node's disk is gone")
        return call_next(msg, context)

    return mod


def _cfg(tmp_path, **extra) -> RunConfig:
    values = {"num-server-rounds": 3, "partition": "iid", "unseen-fraction": 0.0, "min-nodes": 3}
    return RunConfig.from_mapping(values | {"results-dir": str(tmp_path)} | extra)


@pytest.mark.parametrize("dead", [{0, 1, 2}, {1, 2}])
def test_a_round_with_fewer_replies_than_min_train_nodes_stops_the_run_and_resume_finishes_it(tmp_path, dead):
    with pytest.raises(RuntimeError) as err:
        run_in_process(_cfg(tmp_path), 3, client_app=build_client_app([failing(2, dead)]))
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"round 2: {3 - len(dead)} of 3 nodes answered train")
    assert "(min-train-nodes 2)" in line and "the node's disk is gone" in line and f"--resume {tmp_path}" in line
    kept = json.loads((tmp_path / "results.json").read_text())
    assert not kept["complete"] and [r["round"] for r in kept["rounds"]] == [1]
    resumed = run_in_process(_cfg(tmp_path, **{"resume-from": str(tmp_path)}), 3)
    assert resumed["complete"] and [r["round"] for r in resumed["rounds"]] == [1, 2, 3]


def test_a_node_left_out_above_min_train_nodes_does_not_stop_the_run(tmp_path):
    results = run_in_process(_cfg(tmp_path), 3, client_app=build_client_app([failing(2, {2})]))
    assert results["complete"] and {f["round"] for f in results["failures"]} == {2, 3}
    assert all(e["replies"] == 2 for r in results["rounds"][1:] for e in r["exchanges"] if e["type"] == "train")


def info_fails(partitions: set[int]):
    """A mod: nodes of `partitions` raise on the info request (e.g. a Ray node that cannot read the data)."""

    def mod(msg: Message, context: Context, call_next):
        if msg.metadata.message_type == "query.info" and context.node_config["partition-id"] in partitions:
            raise RuntimeError("data folder unreadable here")
        return call_next(msg, context)

    return mod


def test_a_run_whose_nodes_mostly_fail_discovery_stops_before_its_first_round(tmp_path):
    """It went on with 1 of 4 clients and wrote itself complete."""
    with pytest.raises(RuntimeError) as err:
        run_in_process(_cfg(tmp_path), 3, client_app=build_client_app([info_fails({1, 2})]))
    line = str(err.value)
    assert line.startswith("only 1 of 3 nodes answered the info request usably (min-train-nodes 2") and "\n" not in line
    assert "data folder unreadable here" in line
    assert not json.loads((tmp_path / "results.json").read_text())["complete"]
    results = run_in_process(_cfg(tmp_path / "two"), 3, client_app=build_client_app([info_fails({1})]))
    assert results["complete"] and sorted(c["client"] for c in results["clients"]) == ["partition-0", "partition-2"]
