"""Real SuperLink + SuperNodes over gRPC on loopback (2 nodes, 1 round): a node whose training
reply carries 200 MB more than the model is refused for its size, named in results.json, and
the run completes with the other node. On the fast path the ServerApp pulls no more of that
reply than its cap (`flower_internals.pull_replies`); the reason says so.

Every process is started by the test's LocalFederation and stopped by PID; every wait is bounded."""

import json
import os
import re
import subprocess
from pathlib import Path

from florist.deploy.federation import LocalFederation

APP = Path(__file__).parent / "apps" / "bulkyapp"


def test_a_node_replying_200_mb_is_refused_named_and_the_run_completes(tmp_path):
    configs = [{"partition-id": i, "num-partitions": 2, "state-dir": str(tmp_path / "state")} for i in range(2)]
    configs[1]["bulk"] = True  # bulkyapp/apps.py
    fed = LocalFederation(tmp_path, configs, preload="bulkyapp.apps:client")
    fed.env["PYTHONPATH"] = os.pathsep.join([str(APP), fed.env.get("PYTHONPATH", "")])
    out = tmp_path / "out"
    with fed:
        command = [*fed.run_command({})[:2], str(APP), *fed.run_command({})[3:-2]]
        done = subprocess.run(
            [*command, "--run-config", f'results-dir="{out}"'], env=fed.env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["complete"]
    [failure] = results["failures"]
    assert failure["node"].endswith("(partition-1)") and failure["message_type"] == "train"
    assert re.fullmatch(
        r"its reply is over its cap of 64\.\d MB \(max-reply-mb\): \d+\.\d MB or more, no more pulled",
        failure["reason"],
    ), failure["reason"]
    assert results["rounds"][0]["train_loss"] is not None  # partition 0's model counted
    assert [c["client"] for c in results["clients"]] == ["partition-0", "partition-1"]  # both still scored
