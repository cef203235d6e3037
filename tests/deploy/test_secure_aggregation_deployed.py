"""Secure aggregation between real processes (a SuperLink and 4 SuperNodes with florist's warm
executor, which answers each message in a fresh fork: a node's secrets must live in its context
state between the stages): the rounds complete, and a node that shares its keys and then drops out
before its masked upload (its cap on local steps refuses the training) leaves each round to the
other three, with the threshold of 3 met.

Every process is started by the test's LocalFederation and stopped by PID; every wait is bounded.
"""

from processes import node_configs, submit

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
