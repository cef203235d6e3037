"""Nothing a node says about itself ends the run: each bad answer to `query.info` leaves that
node out, named in the results with the reason, and the others train (in-process federations
with one node's info reply rewritten by a client mod). Files planted where florist writes are
not followed, and a default node key says nothing about the machine."""

import os

import numpy as np
import pytest
from flwr.app import Context, Message

from florist.apps.client import build_client_app
from florist.common import protocol
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process


def lying_in_info(partition_id: int, **changes):
    """A mod: node `partition_id` says `changes` in its info reply (config keys or metrics)."""

    def mod(msg: Message, context: Context, call_next):
        reply = call_next(msg, context)
        if msg.metadata.message_type == "query.info" and context.node_config["partition-id"] == partition_id:
            for key, value in changes.items():
                record = "config" if key in ("node-key", "input-shape") else "metrics"
                getattr(reply.content, f"{record}_records")[getattr(protocol, record.upper())][key] = value
        return reply

    return mod


def _run(tmp_path, strategy: str, mod, nodes: int = 3) -> dict:
    cfg = RunConfig.from_mapping(
        {
            "strategy": strategy,
            "num-server-rounds": 1,
            "partition": "iid",
            "unseen-fraction": 0.0,
            "min-nodes": nodes,
            "ckt-steps": 2,
            "results-dir": str(tmp_path),
        }
    )
    return run_in_process(cfg, nodes, client_app=build_client_app([mod]))


@pytest.mark.parametrize(
    ("strategy", "changes", "reason"),
    [
        ("fedavg", {"node-key": "9" * 5000}, "node-key must be 1-128 of"),  # int() of it raised before
        ("fedavg", {"node-key": "a\nb\x1b[31m"}, "node-key must be 1-128 of"),
        ("fedavg", {"input-shape": [1, 9, 9]}, "input shape (1, 9, 9), most nodes' is (1, 8, 8)"),
        ("perfed-ckt", {"num-train": 0}, "it holds no training example"),  # rng.choice raised before
    ],
)
def test_a_node_that_lies_about_itself_is_left_out_and_the_run_completes(tmp_path, strategy, changes, reason):
    results = _run(tmp_path, strategy, lying_in_info(1, **changes))
    assert results["complete"]
    assert [(f["node_id"], f["message_type"]) for f in results["failures"]] == [(101, "query.info")]
    assert reason in results["failures"][0]["reason"]
    assert sorted(c["client"] for c in results["clients"]) == ["partition-0", "partition-2"]
    assert all(c["accuracy"] is not None for c in results["clients"])


def test_a_key_two_nodes_claim_goes_to_neither_and_the_reason_names_both(tmp_path):
    """Node 101 reports node 103's key: answering first used to take it, and 103 was blamed."""
    results = _run(tmp_path, "fedavg", lying_in_info(1, **{"node-key": "partition-3"}), nodes=4)
    assert results["complete"]
    reason = (
        "node key 'partition-3' is claimed by nodes 101 and 103 at once; a key bound to none of its claimers "
        "goes to none"
    )
    assert [(f["node_id"], f["reason"]) for f in results["failures"]] == [(101, reason), (103, reason)]
    assert sorted(c["client"] for c in results["clients"]) == ["partition-0", "partition-2"]


def test_the_write_probe_does_not_follow_a_planted_link(tmp_path):
    from florist.server.results import check_results_dir

    outside = tmp_path / "outside"
    outside.write_text("keep me")
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / f".florist-write-probe-{os.getpid()}").symlink_to(outside)
    with pytest.raises(ValueError, match="cannot be written"):
        check_results_dir(str(folder))
    assert outside.read_text() == "keep me"


def test_a_folder_nodes_default_key_is_opaque(tmp_path):
    from florist.client.node import _identity

    folder = tmp_path / "home" / "alice" / "patients"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        np.savez(folder / f"{split}.npz", x=rng.random((8, 1, 8, 8), dtype="float32"), y=rng.integers(0, 10, 8))
    key = _identity({"data-dir": str(folder)}, RunConfig())[0]
    assert protocol.NODE_KEY.fullmatch(key) and "alice" not in key and "patients" not in key


@pytest.mark.parametrize("append", [False, True])
def test_a_log_replaces_a_planted_link_instead_of_writing_through_it(tmp_path, append):
    from florist.common.storage import open_log

    outside = tmp_path / "outside"
    outside.write_text("keep me")
    (tmp_path / "simulation.log").symlink_to(outside)
    with open_log(tmp_path / "simulation.log", append) as log:
        log.write(b"the run's log")
    assert outside.read_text() == "keep me"
    assert not (tmp_path / "simulation.log").is_symlink()
    assert (tmp_path / "simulation.log").read_bytes() == b"the run's log"
