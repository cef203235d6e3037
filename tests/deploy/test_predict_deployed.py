"""Real processes: after a run between a SuperLink and three SuperNodes, `florist predict`, a
command of its own on the nodes' state folder, scores each node's test split exactly as the run
reported it, for every strategy (the kept network, generated weights, own architecture or
datastore, found by node key and run id). One federation for all of them; one `deploy-local`
besides, as a user's tour runs it."""

import json
import re
import subprocess
import sys

import pytest
from processes import node_configs, submit

from florist.apps.registry import STRATEGIES
from florist.cli import main
from florist.common.processes import marked
from florist.deploy.federation import LocalFederation

# Each strategy's local work cut down; FedAttn's attention acts from round 2 on.
QUICK = {
    "num-server-rounds": 2,
    "local-epochs": 1,
    "finetune-epochs": 1,
    "hn-local-steps": 5,
    "ckt-steps": 5,
    "public-size": 60,
    "fedattn-warmup": 1,
}
SCORE = re.compile(r"accuracy: \d\.\d{4} \((\d+) of (\d+) samples\)")


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    root = tmp_path_factory.mktemp("predicted")
    with LocalFederation(root, node_configs(3, root)) as fed:
        yield fed


def predicted(state_dir, key: str, *flags: str) -> tuple[int, int, list[str]]:
    """`florist predict --split test` as a command: (correct, samples, stderr's lines)."""
    done = subprocess.run(
        [sys.executable, "-m", "florist", "predict", "--node-key", key, "--state-dir", str(state_dir)]
        + ["--split", "test", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    match = SCORE.fullmatch(lines[-1])
    assert match, lines
    return int(match[1]), int(match[2]), lines


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_each_nodes_kept_model_scores_what_the_run_reported(federation, strategy, tmp_path):
    results = submit(federation, tmp_path / "out", **(QUICK | {"strategy": strategy}))
    assert results["complete"] and not results["failures"]
    for client in results["clients"]:
        correct, total, lines = predicted(
            federation.workdir / "state", client["client"], "--run-id", str(results["run_id"])
        )
        assert lines[0].startswith(f"model: node {client['client']}, {strategy}, run {results['run_id']}, ")
        assert total == client["num_test"] and correct / total == client["accuracy"], (strategy, client)


def test_predict_after_deploy_local_finds_the_latest_model_by_node_key(tmp_path):
    out = tmp_path / "out"
    args = ["deploy-local", "--strategy", "knnper", "--num-nodes", "3", "--rounds", "2", "--results-dir", str(out)]
    assert main([*args, "--run-config", "unseen-fraction=0.0"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and not results["failures"]
    assert not marked("FLWR_HOME", str(out / "federation" / "flwr-home"))  # every process it started is gone
    [reported] = [c for c in results["clients"] if c["client"] == "partition-1"]
    correct, total, lines = predicted(out / "federation" / "node-state", "partition-1")
    assert lines[0].startswith(f"model: node partition-1, knnper, run {results['run_id']}, ")
    assert total == reported["num_test"] and correct / total == reported["accuracy"]
