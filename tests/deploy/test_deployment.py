"""Real processes: a SuperLink and SuperNodes on 127.0.0.1 talking over the gRPC Fleet API:
`florist deploy-local` with either executor, a run resumed after its SuperLink was killed, `florist
join`'s refusals.

Every process is started by the test's LocalFederation and stopped by PID; every wait is bounded.
"""

import json
import os
import signal
import subprocess
import time

import pytest

from florist.cli import main
from florist.common.config import RunConfig
from florist.common.processes import marked
from florist.deploy.federation import LocalFederation, free_port
from florist.deploy.join import JoinError, join
from florist.server.inprocess import run_in_process

from processes import RUN, labelled_folder, node_configs, submit, wait_for_rounds


@pytest.mark.parametrize("executor", ["warm", "flower"])
def test_deploy_local_runs_fedavg_over_grpc(tmp_path, executor):
    # Flower's own executor starts a process per message (6-8 CPU-s each here): 1 node, 1 round, no mid-run test.
    nodes, rounds, extra = (3, 2, "") if executor == "warm" else (1, 1, " eval-every=0")
    args = ["deploy-local", "--strategy", "fedavg", "--num-nodes", str(nodes), "--rounds", str(rounds), "--partition",
            "iid", "--results-dir", str(tmp_path / "out"), "--run-config", "unseen-fraction=0.0 local-epochs=2" + extra,
            "--executor", executor]  # fmt: skip
    assert main(args) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["complete"] and len(results["rounds"]) == rounds and not results["failures"]
    assert results["summary"]["seen"]["num_clients"] == nodes
    assert results["summary"]["seen"]["mean_accuracy"] > 0.3  # chance is 0.1
    logs = tmp_path / "out" / "federation" / "logs"
    superlink_log = (logs / "superlink.log").read_text()
    assert "Starting Fleet API (gRPC-rere)" in superlink_log
    assert superlink_log.count("[Fleet.ActivateNode]") >= nodes
    node_log = (logs / "supernode-0.log").read_text()
    if executor == "warm":  # the bundle flwr run built from this checkout is recognised: warm from the first message
        assert node_log.count(": warm process") >= 4 and ": stock process" not in node_log
        served = (logs / "server-executor.log").read_text()  # and the run's ServerApp, forked as warm
        assert served.count(": warm process") == 1 and ": stock process" not in served
    else:
        assert "florist.executor" not in node_log and "Start `flwr-clientapp` process" in node_log
    assert not marked("FLWR_HOME", str(tmp_path / "out" / "federation" / "flwr-home"))  # every process it started is gone


def test_unreachable_superlink_gives_up_with_a_clear_error(tmp_path):
    start = time.monotonic()
    with pytest.raises(JoinError, match="cannot reach the SuperLink"):
        join(f"127.0.0.1:{free_port()}", labelled_folder(tmp_path / "data"), max_wait_time=5)
    assert time.monotonic() - start < 60


def test_join_checks_the_data_folder_before_connecting(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        join("127.0.0.1:9092", tmp_path / "missing")


def test_a_run_whose_superlink_is_killed_resumes_from_its_checkpoint_exactly(tmp_path):
    """SIGKILL to the SuperLink's process group after round 1 of 3 (the run's ServerApp, forked
    warm, ends with it); the SuperLink restarts with its database, keeps its nodes, and the run
    goes on from its checkpoint with `resume-from` to the accuracies of an uninterrupted run."""
    out = tmp_path / "out"
    config = RUN | {"num-server-rounds": 3, "partition": "dirichlet:0.5", "min-nodes": 3, "results-dir": str(out)}
    with LocalFederation(tmp_path, node_configs(3, tmp_path), persistent=True) as fed:
        before = fed.online_nodes()
        run = subprocess.Popen(fed.run_command(config), env=fed.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)  # fmt: skip
        try:
            wait_for_rounds(run, out / "results.json", 1, timeout=300)
            os.killpg(fed.superlink.pid, signal.SIGKILL)
        finally:
            run.kill()
            run.communicate(timeout=30)
        fed.superlink.popen.wait(30)
        fed.start_superlink()
        fed.wait_for_nodes(3, timeout=180)
        assert fed.online_nodes() == before
        resumed = submit(fed, out, **config, **{"resume-from": str(out)})
    assert resumed["complete"] and [r["round"] for r in resumed["rounds"]] == [1, 2, 3]
    whole = run_in_process(RunConfig.from_mapping(config | {"results-dir": str(tmp_path / "whole")}), 3)
    assert {c["client"]: c["accuracy"] for c in resumed["clients"]} == {c["client"]: c["accuracy"] for c in whole["clients"]}
