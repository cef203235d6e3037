"""Another Flower than the one florist's fast path was written for: every Python process of a run
(the CLI, Ray's workers, the SuperLink, the SuperNodes and their SuperExecs, the ServerApp and
ClientApp processes) imports a Flower that claims to be 1.39.1, through a sitecustomize on
PYTHONPATH; the guard's own check sees it as it would see a real patch release. (No Flower
release after 1.39.0 keeps the gRPC Fleet API: the package index has 1.40.0 next, which moved it
to HTTP; so the version is faked rather than installed.)

`florist simulate` and `florist deploy-local` still complete, on Flower's stock paths, the
latter saying so in one line per process; nothing prints a traceback.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import flwr
import pytest

from florist.common import flower_internals
from florist.common.processes import marked
from florist.deploy import supernode
from florist.deploy.bundle import app_dir, checkout
from florist.deploy.spawning import flower_env, free_port

CLAIMED = "1.39.1"
WARNING = (
    f"florist: Flower {CLAIMED} is installed, florist's fast path was written for {flower_internals.PINNED} "
    "(the internals it checks are unchanged): using Flower's stock paths"
)
SITECUSTOMIZE = f'''"""Flower claims version {CLAIMED} in every process that has this folder on PYTHONPATH."""

import importlib.abc
import importlib.util
import sys


class _ClaimVersion(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "flwr":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("flwr")
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                module.__version__ = "{CLAIMED}"

            spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _ClaimVersion())
'''


@pytest.fixture(scope="module")
def claimed(tmp_path_factory) -> dict[str, str]:
    """The environment of a process tree in which Flower claims to be 1.39.1."""
    folder = tmp_path_factory.mktemp("claimed-flower")
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    env = flower_env() | {"PYTHONPATH": path}  # Flower's executables on PATH, as `LocalFederation` has them
    done = subprocess.run(
        [sys.executable, "-c", "import flwr\nfrom florist.common import flower_internals\nprint(flwr.__version__)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # importing flwr and florist: seconds, but a minute and more on a loaded machine
    )
    assert done.stdout == f"{CLAIMED}\n" and not done.stderr, done.stderr
    return env


def _florist(args: list[str], env: dict[str, str], cwd, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "florist", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def _complete(results_dir) -> dict:
    results = json.loads((results_dir / "results.json").read_text())
    assert results["complete"] and len(results["rounds"]) == 1 and not results["failures"]
    assert results["summary"]["seen"]["num_clients"] == 2
    return results


def test_simulate_completes_on_stock_flower_without_a_word(claimed, tmp_path):
    done = _florist(
        [
            "simulate",
            "--runtime",
            "simulation",
            "--num-clients",
            "2",
            "--rounds",
            "1",
            "--results-dir",
            str(tmp_path / "out"),
        ],
        claimed,
        tmp_path,
        300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _complete(tmp_path / "out")
    output = done.stdout + done.stderr
    assert "Traceback" not in output and "florist: Flower" not in output  # its one patch falls back silently


def test_deploy_local_runs_on_flowers_stock_paths_saying_so_once_per_process(claimed, tmp_path):
    out = tmp_path / "out"
    done = _florist(
        ["deploy-local", "--num-nodes", "2", "--rounds", "1", "--results-dir", str(out)], claimed, tmp_path, 600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _complete(out)
    # The CLI's process says it on stderr; the ServerApp's line, if any, comes with the run's log stream.
    assert [line for line in done.stderr.splitlines() if "florist: Flower" in line] == [WARNING]
    assert done.stdout.count("florist: Flower") <= 1 and "Traceback" not in done.stdout + done.stderr
    logs = out / "federation" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["superlink.log", "supernode-0.log", "supernode-1.log"]
    for node in ("supernode-0.log", "supernode-1.log"):  # Flower's own executor, Flower's own polling
        text = (logs / node).read_text()
        assert text.count(WARNING) == 1 and "Start `flwr-clientapp` process" in text and "florist.executor" not in text
    assert not marked("FLWR_HOME", str(out / "federation" / "flwr-home"))  # all it started is gone


def test_a_warm_supernode_runs_flowers_own_executor_instead(claimed, tmp_path):
    """`florist supernode --executor warm` (what `join` and the compose file start) on another
    Flower: Flower's SuperNode and SuperExec, no warm executor. With no SuperLink to reach, the
    SuperNode gives up at once; its SuperExec retries a while longer (Flower's), so it is stopped
    with the process group this test made."""
    args = ["supernode", "--executor", "warm", "--isolation", "process", "--insecure", "--max-retries", "1"]
    args += ["--superlink", f"127.0.0.1:{free_port()}", "--port", str(free_port())]
    log = tmp_path / "supernode.log"
    with open(log, "wb") as handle:
        node = subprocess.Popen(
            [sys.executable, "-m", "florist", *args],
            env=claimed,
            cwd=tmp_path,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        assert node.wait(120) == 1  # Flower's exit code 305: the SuperLink is unreachable
    finally:
        node.kill() if node.poll() is None else None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGTERM)
    output = log.read_text()
    assert output.count("florist: Flower") == 1 and WARNING in output and "Exit Code: 305" in output
    assert "florist.executor" not in output and "Traceback" not in output


def test_off_the_fast_path_the_pieces_fall_back(monkeypatch):
    monkeypatch.setattr(flwr, "__version__", CLAIMED)
    flower_internals.forget()
    try:
        assert app_dir() == checkout()  # `flwr run` gets the checkout itself
    finally:
        flower_internals.forget()
    assert supernode._without_process_isolation(["--isolation", "process", "--insecure"]) == ["--insecure"]
    assert supernode._without_process_isolation(["--isolation=process", "--port", "9"]) == ["--port", "9"]
    assert supernode._without_process_isolation(["--isolation", "subprocess"]) == ["--isolation", "subprocess"]
    started = []
    monkeypatch.setitem(sys.modules, "flwr.supernode.cli", None)  # as if Flower had moved its entry point
    monkeypatch.setattr(os, "execvp", lambda program, args: started.append((program, args)))
    flower_internals.supernode_main(["--insecure"])  # its executable instead
    assert started == [(str(Path(sys.executable).with_name("flower-supernode")), ["flower-supernode", "--insecure"])]


def test_the_warm_executor_refuses_in_one_line_where_flowers_task_runtime_moved(monkeypatch):
    from florist.deploy import executor

    monkeypatch.setitem(sys.modules, "flwr.supercore.runtime", None)  # as if Flower had moved it
    flower_internals.forget()
    try:
        with pytest.raises(SystemExit, match=r"^florist: no warm executor on this Flower: Flower 1\.39\.0 .*runtime: "):
            executor.preload(executor.DEFAULT_APP)
    finally:
        flower_internals.forget()
