"""Real processes: one federation of three SuperNodes that every test here shares, and a
fourth node each test starts after training (the serve phase), or a node killed mid-run (the
last test: the others need all three)."""

import json
import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from processes import EXPIRY, RUN, node_configs, streaming_run, wait_for_rounds

from florist.client import personal
from florist.common.data import load_digits
from florist.common.models import build_model
from florist.deploy.federation import LocalFederation
from florist.strategies.knnper.client import LAMBDA_GRID


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """Three SuperNodes for the tests below, and a fourth slot each test fills with its own late
    joiner: one federation (and one install of the app bundle) for all of them."""
    root = tmp_path_factory.mktemp("shared")
    fed = LocalFederation(root, node_configs(4, root))
    try:
        fed.start(num_started=3)
        yield fed
    finally:
        fed.stop()


@pytest.fixture(autouse=True)
def three_nodes_alive(federation):
    """A test that finds a node of the three dead says so, rather than failing for a reason of its own."""
    dead = [node.name for node in federation.nodes[:3] if not node.alive()]
    assert not dead, f"{dead} died in an earlier test (logs in {federation.logs})"


def run_with_late_joiner(fed: LocalFederation, tmp_path: Path, late: dict | None = None, **overrides) -> dict:
    """Train with the federation's three SuperNodes, then start a fourth one (node config `late`,
    else partition 3); the server serves it before finishing. The fourth one is stopped again."""
    fed.node_configs[3] = late or node_configs(4, fed.workdir)[3]
    config = RUN | {"min-nodes": 3, "serve-seconds": 240.0, "serve-count": 1, "results-dir": str(tmp_path / "out")}
    config |= overrides
    progress = tmp_path / "out" / "results.json"
    try:
        with streaming_run(fed, config) as run:
            wait_for_rounds(run, progress, config["num-server-rounds"], timeout=400)  # training done
            fed.start_node(3)  # the late joiner
            output, _ = run.communicate(timeout=600)
            assert run.returncode == 0, output[-3000:]
    finally:
        if fed.nodes[3]:
            fed.nodes[3].stop()
            fed.nodes[3] = None
    results = json.loads(progress.read_text())
    assert results["summary"]["seen"]["num_clients"] == 3
    [joined] = [c for c in results["clients"] if not c["seen"]]  # joined after training: unseen
    assert joined["client"] == (late or {}).get("node-key", "partition-3")
    return results


def test_knnper_personalizes_a_node_that_joins_after_training(federation, tmp_path):
    results = run_with_late_joiner(
        federation, tmp_path, strategy="knnper", partition="pathological:2", **{"num-server-rounds": 1}
    )
    [late] = [c for c in results["clients"] if c["client"] == "partition-3"]
    assert results["summary"]["unseen"]["num_clients"] == 1  # scored
    kept = federation.workdir / "state" / "partition-3" / "knnper"  # in its state folder: its train split
    assert (kept / "datastore.npz").exists()
    assert json.loads((kept / "datastore.json").read_text())["size"] == late["num_train"]
    assert late["datastore_size"] > late["num_train"] and late["lambda"] in LAMBDA_GRID  # scored with validation too


def test_odpfl_serves_a_late_node_that_has_no_labels(federation, tmp_path):
    folder = tmp_path / "newcomer"
    folder.mkdir()
    x, _ = load_digits()
    np.savez(folder / "train.npz", x=x[:80])  # no y anywhere: nothing to train or score with
    np.savez(folder / "test.npz", x=x[80:100])
    late = {"data-dir": str(folder), "node-key": "newcomer", "state-dir": str(tmp_path / "state"), "dp-epsilon": 3.0}
    results = run_with_late_joiner(
        federation,
        tmp_path,
        late,
        strategy="odpfl",
        partition="pathological:2",
        **{"num-server-rounds": 1, "hn-local-steps": 10},
    )
    assert math.isfinite(results["rounds"][0]["train_loss"])  # the three exchanges of a round completed
    assert [e["type"] for e in results["rounds"][0]["exchanges"]] == [
        "query.describe",
        "train.generated",
        "train.encoder",
        "query.describe",
        "evaluate.generated",
    ]
    [newcomer] = [c for c in results["clients"] if c["client"] == "newcomer"]
    assert newcomer["accuracy"] is None and newcomer["dp_epsilon"] == 3.0 and newcomer["dp_sigma"] > 0
    assert newcomer["descriptor_size"] == newcomer["num_train"]
    kept = personal.find(tmp_path / "state", "newcomer")  # the node keeps its model, unscored
    assert kept.manifest["strategy"] == "odpfl" and kept.manifest["accuracy"] is None
    assert kept.network().state_dict().keys() == build_model("cnn", (1, 8, 8), 10).state_dict().keys()
    assert not [f for f in results["failures"] if f["node"].endswith("(newcomer)")]


def test_perfed_ckt_nodes_with_three_architectures_share_only_soft_decisions(federation, tmp_path):
    late = node_configs(4, federation.workdir)[3] | {"model": "mlp"}  # node config wins over client-models
    results = run_with_late_joiner(
        federation,
        tmp_path,
        late,
        strategy="perfed-ckt",
        **{"num-server-rounds": 2, "eval-every": 0, "client-models": "cnn,mlp,cnn-wide", "ckt-steps": 10},
    )
    clients = {c["client"]: c for c in results["clients"]}
    assert not results["failures"] and all(c["accuracy"] is not None for c in clients.values())
    assert len({clients[f"partition-{i}"]["num_params"] for i in range(3)}) == 3
    assert clients["partition-3"]["num_params"] == clients["partition-1"]["num_params"]  # both mlp
    assert clients["partition-3"]["rounds_trained"] == 0 and clients["partition-3"]["cluster"] >= 0
    for i in range(4):  # every node keeps its own model in its state folder (by run and round)
        assert list((federation.workdir / "state" / f"partition-{i}" / "perfed-ckt").glob("model-*.npz"))
    assert all(r["fedavg_bytes_up"] > 5 * r["train_bytes_up"] for r in results["rounds"])


def test_fedattn_personalizes_a_late_joiner_from_its_nearest_clients(federation, tmp_path):
    results = run_with_late_joiner(
        federation,
        tmp_path,
        strategy="fedattn",
        **{"num-server-rounds": 1, "eval-every": 0, "fedattn-warmup": 0, "fedattn-k": 2},
    )
    clients = {c["client"]: c for c in results["clients"]}
    assert not results["failures"] and all(c["accuracy"] is not None for c in clients.values())
    assert clients["partition-3"]["neighbours"] == 2 and 0.5 <= clients["partition-3"]["attention_max"] <= 1
    assert not (federation.workdir / "state" / "partition-0" / "fedattn").exists()  # a FedAttn client keeps nothing


def test_a_supernode_killed_mid_run_is_left_out(federation, tmp_path):
    fed = federation
    config = RUN | {
        "min-nodes": 3,
        "num-server-rounds": 2,
        "round-timeout": EXPIRY,
        "eval-every": 0,
        "results-dir": str(tmp_path / "out"),
    }  # each exchange with the dead node waits out the timeout
    progress = tmp_path / "out" / "results.json"
    with streaming_run(fed, config) as run:
        wait_for_rounds(run, progress, 1, timeout=300)
        os.kill(fed.nodes[2].pid, signal.SIGKILL)
        output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output[-3000:]
    results = json.loads(progress.read_text())
    assert results["complete"] and len(results["rounds"]) == 2
    assert results["failures"] and all("partition-2" in f["node"] for f in results["failures"])
    assert "partition-2" in output  # the server log names the node that failed
    scored = {c["client"]: c["accuracy"] for c in results["clients"]}
    assert scored["partition-2"] is None and scored["partition-0"] is not None and scored["partition-1"] is not None
