"""Real processes: after a 3-node `florist deploy-local` run of kNN-Per, `florist predict` as a
command of its own, on a node's state folder, scores that node's test split exactly as the
run reported it (the kept network and datastore, found by node key)."""

import json
import re
import subprocess
import sys

from florist.cli import main
from florist.common.processes import marked


def test_predict_after_deploy_local_reproduces_each_nodes_reported_accuracy(tmp_path):
    out = tmp_path / "out"
    args = ["deploy-local", "--strategy", "knnper", "--num-nodes", "3", "--rounds", "2", "--results-dir", str(out)]
    assert main([*args, "--run-config", "unseen-fraction=0.0"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and not results["failures"]
    assert not marked("FLWR_HOME", str(out / "federation" / "flwr-home"))  # every process it started is gone
    reported = {c["client"]: c for c in results["clients"]}
    done = subprocess.run(
        [sys.executable, "-m", "florist", "predict", "--node-key", "partition-1"]
        + ["--state-dir", str(out / "federation" / "node-state"), "--split", "test"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith(f"model: node partition-1, knnper, run {results['run_id']}, ")
    match = re.fullmatch(r"accuracy: (\d\.\d{4}) \((\d+) of (\d+) samples\)", lines[-1])
    assert match, lines
    correct, total = int(match[2]), int(match[3])
    assert total == reported["partition-1"]["num_test"] and correct / total == reported["partition-1"]["accuracy"]
    assert len(done.stdout.strip().splitlines()) == 1 + total  # the header, a row per sample
