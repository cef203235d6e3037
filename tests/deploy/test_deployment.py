"""Real processes: a SuperLink and SuperNodes on 127.0.0.1 talking over the gRPC Fleet API:
`florist deploy-local` with Flower's own executor, `florist join`'s refusals.

Every process is started by the test's LocalFederation and stopped by PID; every wait is bounded.
"""

import json
import time

import pytest
from processes import labelled_folder

from florist.cli import main
from florist.common.processes import marked
from florist.deploy.join import JoinError, join
from florist.deploy.spawning import free_port


def test_deploy_local_with_flowers_own_executor_runs_fedavg_over_grpc(tmp_path):
    """`--executor flower`: Flower's own runtime, a process per message (6-8 CPU-s each here), so
    1 node, 1 round. (florist's warm executor under `deploy-local`: test_interrupt.py.)"""
    args = [
        "deploy-local",
        "--strategy",
        "fedavg",
        "--num-nodes",
        "1",
        "--rounds",
        "1",
        "--partition",
        "iid",
        "--results-dir",
        str(tmp_path / "out"),
        "--run-config",
        "unseen-fraction=0.0 local-epochs=2 eval-every=0",
        "--executor",
        "flower",
    ]
    assert main(args) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["complete"] and len(results["rounds"]) == 1 and not results["failures"]
    assert results["summary"]["seen"]["num_clients"] == 1
    assert results["summary"]["seen"]["mean_accuracy"] > 0.3  # chance is 0.1
    logs = tmp_path / "out" / "federation" / "logs"
    superlink_log = (logs / "superlink.log").read_text()
    assert "Starting Fleet API (gRPC-rere)" in superlink_log and "[Fleet.ActivateNode]" in superlink_log
    node_log = (logs / "supernode-0.log").read_text()
    assert "florist.executor" not in node_log and "Start `flwr-clientapp` process" in node_log
    assert not marked("FLWR_HOME", str(tmp_path / "out" / "federation" / "flwr-home"))  # all it started is gone


def test_a_deployed_run_that_stops_midway_is_one_line_and_exit_2(tmp_path, capfd):
    """Flower's `flwr run` exits 0 when the ServerApp raises; deploy-local reads why the run
    stopped from its results.json and says it in one line (a round timeout of 10 ms: no node
    answers in time, or the SuperLink refuses messages that expire at once). The streamed log
    says it in one line too: Flower would log the ServerApp's traceback."""
    args = ["deploy-local", "--num-nodes", "2", "--rounds", "2", "--results-dir", str(tmp_path / "out")]
    assert main([*args, "--run-config", "round-timeout=0.01"]) == 2
    out, err = capfd.readouterr()
    last = err.strip().splitlines()[-1]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert not results["complete"] and last == f"florist: error: {results['error']}", last
    said = (out + err).count(f"florist: error: {results['error'][:60]}")  # results.json keeps a long one cut
    assert "Traceback" not in out + err and said == 2, said


def test_unreachable_superlink_gives_up_with_a_clear_error(tmp_path):
    start = time.monotonic()
    with pytest.raises(JoinError, match="cannot reach the SuperLink"):
        join(f"127.0.0.1:{free_port()}", labelled_folder(tmp_path / "data"), insecure=True, max_wait_time=5)
    assert time.monotonic() - start < 60


def test_join_checks_the_data_folder_before_connecting(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        join("127.0.0.1:9092", tmp_path / "missing")
