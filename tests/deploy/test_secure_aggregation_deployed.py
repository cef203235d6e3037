"""Secure aggregation between real processes (a SuperLink and 4 SuperNodes with florist's warm
executor, which answers each message in a fresh fork: a node's secrets must live in its context
state between the stages): the rounds complete, and a node that shares its keys and then drops out
before its masked upload (its cap on local steps refuses the training; or its SuperNode is killed
as the training request arrives) leaves each round to the other three, with the threshold of 3 met.

Every process is started by the test's LocalFederation and stopped by PID; every wait is bounded.
"""

import json
import os
import signal
import time

from processes import EXPIRY, RUN, node_configs, streaming_run, submit

from florist.deploy.federation import LocalFederation


def test_a_node_that_drops_between_key_sharing_and_its_masked_upload_leaves_the_round_to_the_others(tmp_path):
    configs = node_configs(4, tmp_path)
    configs[1] |= {"node-max-steps": 1}  # answers the key exchanges, refuses to train
    out = tmp_path / "out"
    fed = LocalFederation(tmp_path, configs)
    try:
        fed.start()
        results = submit(fed, out, **{"num-server-rounds": 2, "secure-aggregation": "secaggplus"})
    finally:
        fed.stop()
    assert results["complete"]
    for row in results["rounds"]:
        assert (row["secagg_survivors"], row["secagg_dropped"], row["secagg_clipped"]) == (3, ["partition-1"], 0)
        replies = {e["type"]: (e["nodes"], e["replies"]) for e in row["exchanges"]}
        assert replies["query.secagg_shares"] == (4, 4) and replies["train.secagg"] == (4, 3)
        assert replies["query.secagg_unmask"] == (3, 3)
    dropped = {(f["round"], f["node"].split("(")[-1].rstrip(")"), f["message_type"]) for f in results["failures"]}
    assert dropped == {(1, "partition-1", "train.secagg"), (2, "partition-1", "train.secagg")}
    assert all("node-max-steps" in f["reason"] for f in results["failures"])
    assert all(c["accuracy"] > 0.3 for c in results["clients"])  # the three trained a model the fourth scores too


def test_a_supernode_killed_after_sharing_its_keys_leaves_the_round_to_the_others(tmp_path):
    """SIGKILL to partition-2's SuperNode the moment its log shows the training request of round 1
    (its keys and shares are out; its masked vector never comes): the server waits the round-timeout
    out, unmasks the three survivors' sum by rebuilding the dead node's masks from their shares, and
    round 2 goes on without it."""
    out = tmp_path / "out"
    config = RUN | {
        "min-nodes": 4,
        "num-server-rounds": 2,
        "round-timeout": EXPIRY,
        "eval-every": 0,
        "secure-aggregation": "secaggplus",
        "results-dir": str(out),
    }
    fed = LocalFederation(tmp_path, node_configs(4, tmp_path))
    try:
        fed.start()
        victim = fed.logs / "supernode-2.log"
        with streaming_run(fed, config) as run:
            deadline = time.monotonic() + 300
            while "Receiving: train.secagg message" not in victim.read_text(errors="replace"):
                assert run.poll() is None and time.monotonic() < deadline, "no train.secagg reached partition-2"
                time.sleep(0.02)
            os.kill(fed.nodes[2].pid, signal.SIGKILL)
            output, _ = run.communicate(timeout=600)
        assert run.returncode == 0, output[-3000:]
    finally:
        fed.stop()
    results = json.loads((out / "results.json").read_text())
    first, second = results["rounds"]
    assert results["complete"]
    assert (first["secagg_survivors"], first["secagg_dropped"]) == (3, ["partition-2"])
    assert (second["secagg_survivors"], second["secagg_dropped"]) == (3, [])  # gone before sharing keys
    assert all("partition-2" in f["node"] for f in results["failures"])
    scored = {c["client"]: c["accuracy"] for c in results["clients"]}
    assert scored["partition-2"] is None and all(scored[f"partition-{i}"] > 0.3 for i in (0, 1, 3))
