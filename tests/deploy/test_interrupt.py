"""Ctrl-C stops a run within seconds, keeps the rounds it finished, and leaves no process
behind: Ray's workers in simulation, the SuperLink, SuperNodes and their ClientApps in
deployment (whose messages, over the gRPC Fleet API, the warm executor serves). `florist
simulate --resume` then finishes the interrupted simulation in Ray's workers where the
uninterrupted run ends."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid

import pytest
from processes import started_tasks, wait_for_rounds

from florist.cli import main
from florist.common.processes import alive, descendants, marked
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process


def _interrupt(command: list[str], progress, tmp_path) -> tuple[subprocess.CompletedProcess, str, list[int]]:
    """Start `florist COMMAND` tagged in its environment, Ctrl-C it once a round is saved in
    `progress`, and again while it stops, as an impatient user does (the second must not cut
    the stop short), and return its output, the tag its descendants carried, and the processes
    below it at the Ctrl-C (some of Ray's do not carry the tag)."""
    tag, log = uuid.uuid4().hex, tmp_path / "output.txt"
    with open(log, "w") as out:  # a file, not a pipe: nothing blocks on a full pipe
        run = subprocess.Popen(
            [sys.executable, "-m", "florist", *command],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env=os.environ | {"FLORIST_TEST_TAG": tag},
        )
    try:
        wait_for_rounds(run, progress, 1, timeout=300)
        below = descendants([run.pid])
        run.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            run.wait(timeout=0.5)
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
        run.wait(timeout=30)  # the bar is 5 s; the margin is for a loaded machine (load 18 on 2 cores)
    finally:
        run.kill()
    return subprocess.CompletedProcess(run.args, run.returncode, log.read_text()), tag, below


@pytest.mark.parametrize("command", ["simulate", "deploy-local"])
def test_ctrl_c_stops_the_run_and_keeps_the_finished_rounds(command, tmp_path):
    out = tmp_path / "out"
    # One SuperNode has the process tree a Ctrl-C must end (its executor and ClientApps); each more costs a start.
    # The simulation is resumed below: 12 rounds (0.6 s each after the first), most left after the Ctrl-C.
    nodes = (
        ["--num-clients", "3", "--rounds", "12", "--runtime", "simulation"]  # Ray's process tree, whatever the cores
        if command == "simulate"
        else ["--num-nodes", "1", "--rounds", "100"]
    )
    done, tag, below = _interrupt(
        [command, *nodes, "--partition", "iid", "--results-dir", str(out), "--run-config", "unseen-fraction=0.0"],
        out / "results.json",
        tmp_path,
    )
    assert done.returncode == 130, done.stdout[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("florist: interrupted after ") and str(out) in last and "Traceback" not in done.stdout
    assert last.endswith(f"(go on with --resume {out})"), last
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] is False and len(results["rounds"]) >= 1
    assert not marked("FLORIST_TEST_TAG", tag)  # no process it started outlives it: Ray's, the federation's
    assert len(below) >= 3 and not [pid for pid in below if alive(pid)]  # nor one without the tag
    if command == "deploy-local":  # over the gRPC Fleet API, every message served warm: forked, not a new process
        assert "Submit a run" not in done.stdout  # it submits the run itself
        logs = out / "federation" / "logs"
        superlink_log = (logs / "superlink.log").read_text()
        assert "Starting Fleet API (gRPC-rere)" in superlink_log and "[Fleet.ActivateNode]" in superlink_log
        node_started = started_tasks((logs / "supernode-0.log").read_text())  # flwr run's bundle is recognised
        assert len(node_started) >= 3 and set(node_started) == {"warm"}  # info, train, evaluate
        # and the run's ServerApp, forked as warm (whether its kill by the Ctrl-C is logged too depends on timing)
        assert started_tasks((logs / "server-executor.log").read_text()) == ["warm"]
        # Flower colours its lines whatever they go to: a forked executor's and its ClientApps' must be plain
        assert [log.name for log in sorted(logs.glob("*.log")) if "\x1b[" in log.read_text()] == []
    if command == "simulate":
        assert main(["simulate", "--resume", str(out)]) == 0  # its own config, from its folder
        resumed = json.loads((out / "results.json").read_text())
        assert resumed["complete"] and [r["round"] for r in resumed["rounds"]] == list(range(1, 13))
        whole = run_in_process(RunConfig.from_mapping(results["config"] | {"results-dir": str(tmp_path / "whole")}), 3)
        assert {c["client"]: c["accuracy"] for c in resumed["clients"]} == {
            c["client"]: c["accuracy"] for c in whole["clients"]
        }
