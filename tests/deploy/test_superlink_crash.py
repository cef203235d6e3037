"""Real processes: a run whose SuperLink is killed mid-run goes on from its checkpoint once the
SuperLink is back, to the accuracies of a run that was never interrupted.

Every process is started by the test's LocalFederation and stopped by PID; every wait is bounded.
"""

import os
import signal
import subprocess

from processes import RUN, node_configs, stop_runs, submit, wait_for_rounds

from florist.config import RunConfig
from florist.deploy.federation import LocalFederation
from florist.runners.inprocess import run_in_process


def test_a_run_whose_superlink_is_killed_resumes_from_its_checkpoint_exactly(tmp_path):
    """SIGKILL to the SuperLink's process group after round 1 of 2 (the run's ServerApp, forked
    warm, ends with it); the SuperLink restarts with its database, keeps its nodes, and the run
    goes on from its checkpoint with `resume-from` to the accuracies of an uninterrupted run
    once the dead run is stopped (`flwr stop`, as the README's resume section says)."""
    out = tmp_path / "out"
    config = RUN | {"num-server-rounds": 2, "partition": "dirichlet:0.5", "min-nodes": 2, "results-dir": str(out)}
    with LocalFederation(tmp_path, node_configs(2, tmp_path), persistent=True) as fed:
        before = fed.online_nodes()
        run = subprocess.Popen(
            fed.run_command(config), env=fed.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            wait_for_rounds(run, out / "results.json", 1, timeout=300)
            os.killpg(fed.superlink.pid, signal.SIGKILL)
        finally:
            run.kill()
            run.communicate(timeout=30)
        fed.superlink.popen.wait(30)
        fed.start_superlink()
        fed.wait_for_nodes(2, timeout=180)
        assert fed.online_nodes() == before
        # The killed run is still "running" in the database; stopped, a node that held one of its
        # messages drops it at once (else it retries it until the SuperLink finds the run dead).
        stop_runs(fed)
        resumed = submit(fed, out, **config, **{"resume-from": str(out)})
    assert resumed["complete"] and [r["round"] for r in resumed["rounds"]] == [1, 2]
    whole = run_in_process(RunConfig.from_mapping(config | {"results-dir": str(tmp_path / "whole")}), 2)
    assert {c["client"]: c["accuracy"] for c in resumed["clients"]} == {
        c["client"]: c["accuracy"] for c in whole["clients"]
    }
