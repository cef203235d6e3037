"""Helpers of the real-process tests: node configs, run submission, bounded waits."""

import contextlib
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from florist.deploy.federation import CONNECTION, LocalFederation

RUN = {"strategy": "fedavg", "partition": "iid", "local-epochs": 2, "unseen-fraction": 0.0, "round-timeout": 120.0}
# The round-timeout of a run that waits one out for a dead or hung node, once per exchange with
# it: healthy exchanges took up to 5 s on 2 cores at load 13, up to 18 was seen beside other
# work, so four times that still holds.
EXPIRY = 20.0


def node_configs(n: int, root: Path) -> list[dict]:
    return [{"partition-id": i, "num-partitions": n, "state-dir": str(root / "state")} for i in range(n)]


def connected_pids(port: int) -> set[int]:
    """PIDs holding an ESTABLISHED TCP connection to local `port` (read from /proc; gRPC uses
    IPv4-mapped IPv6 sockets, so both tables count)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[2].split(":")[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                pids.add(int(pid))
        except OSError:
            continue
    return pids


def submit(fed: LocalFederation, results: Path, **overrides) -> dict:
    config = RUN | {"min-nodes": len(fed.nodes), "results-dir": str(results)} | overrides
    done = subprocess.run(fed.run_command(config), env=fed.env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((results / "results.json").read_text())


@contextlib.contextmanager
def streaming_run(fed: LocalFederation, config: dict) -> Iterator[subprocess.Popen]:
    """`flwr run` of `config` on `fed`, its output piped. A block that fails stops the run on the
    SuperLink too: on a federation that tests share, its ServerApp would reach into the next test."""
    run = subprocess.Popen(
        fed.run_command(config), env=fed.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        yield run
    except BaseException:
        stop_runs(fed)
        raise
    finally:
        if run.poll() is None:
            run.kill()
        run.communicate(timeout=30)


def stop_runs(fed: LocalFederation) -> None:
    """`flwr stop` every run the federation's SuperLink has not finished."""
    listed = fed.flwr("ls", CONNECTION, "--format", "json")
    for run in json.loads(listed.stdout or "{}").get("runs", []):
        if not run["status"].startswith("finished"):
            fed.flwr("stop", run["run-id"], CONNECTION)


def started_tasks(executor_log: str) -> list[str]:
    """How a warm executor started each task it served, in order: "warm" (forked) or "stock".
    Only the start lines count: whether a task's end is logged too depends on timing."""
    return re.findall(r"task \d+ of run \d+: (warm|stock) process", executor_log)


def wait_for_rounds(run: subprocess.Popen, progress: Path, rounds: int, timeout: float) -> None:
    """Until the run's checkpointed results.json lists `rounds` rounds; fails if the run ends first.
    Polls every 0.1 s: a test that cuts a node off "as the next round starts" must act well within
    one exchange (~1 s), or the node's reply may already be in."""
    deadline = time.monotonic() + timeout
    while not (progress.exists() and len(json.loads(progress.read_text())["rounds"]) >= rounds):
        assert run.poll() is None, run.stdout.read()[-3000:] if run.stdout else f"exited with {run.returncode}"
        assert time.monotonic() < deadline, f"fewer than {rounds} rounds after {timeout:.0f} s"
        time.sleep(0.1)


def labelled_folder(path: Path) -> Path:
    rng = np.random.default_rng(0)
    path.mkdir(parents=True)
    for split in ("train", "test"):
        np.savez(path / f"{split}.npz", x=rng.random((20, 1, 8, 8), dtype=np.float32), y=rng.integers(0, 10, 20))
    return path
