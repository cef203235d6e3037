"""The warm executor between real processes: what it runs warm, what it leaves to Flower's
own per-message process, and how it survives a handler that raises or hangs."""

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import EXPIRY, node_configs, started_tasks
from processes import submit as run_submit

from florist.common.processes import marked
from florist.deploy import forkserver
from florist.deploy.bundle import app_dir, checkout
from florist.deploy.federation import LocalFederation
from florist.deploy.preloaded import PreloadedApp

APPS = Path(__file__).parent / "apps"


@pytest.fixture(scope="module")
def florist_app():
    return PreloadedApp.load("florist.apps.client:app")


def bundle(tmp_path: Path, change=None) -> Path:
    """florist as an installed app bundle would hold it: pyproject.toml and the package."""
    fab = tmp_path / "fab"
    shutil.copytree(checkout() / "florist", fab / "florist", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(checkout() / "pyproject.toml", fab)
    if change:
        change(fab)
    return fab


def test_the_preloaded_app_is_fingerprinted_as_it_was_imported(florist_app):
    assert florist_app.distribution[0] == "florist"
    path = checkout() / "florist" / "apps" / "client.py"
    assert florist_app.files["florist/apps/client.py"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_preloading_florist_pays_the_first_use_costs_before_any_fork():
    """Each message runs in a child forked from the preloaded process: what the preload leaves
    unimported, every child imports again (the data stack: 3 s of CPU per message on 2 cores)."""
    probe = (
        "import sys; from florist.deploy import executor; executor.preload(executor.DEFAULT_APP); "
        "print(sorted(m for m in ('datasets', 'flwr_datasets.partitioner', 'sklearn.datasets') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.stdout.split("\n")[-2] == "['datasets', 'flwr_datasets.partitioner', 'sklearn.datasets']", done.stderr


def test_the_bundle_flwr_run_builds_from_the_checkout_is_known_before_it_is_installed(florist_app):
    from flwr.cli.build import build_fab_from_disk

    assert florist_app.bundle_hash == hashlib.sha256(build_fab_from_disk(app_dir())).hexdigest()


def test_only_a_bundle_with_exactly_the_preloaded_code_is_served_warm(florist_app, tmp_path):
    same = bundle(tmp_path / "same")
    assert florist_app.mismatch(same) is None and florist_app.mismatch(same, "serverapp") is None  # SuperLink's too

    def edit(fab):
        (fab / "florist" / "common" / "metrics.py").write_text("# changed\n")

    assert "florist/common/metrics.py" in florist_app.mismatch(bundle(tmp_path / "edited", edit))

    def other_app(fab):
        text = (fab / "pyproject.toml").read_text()
        (fab / "pyproject.toml").write_text(
            text.replace('clientapp = "florist.apps.client:app"', 'clientapp = "x:app"')
        )

    assert "its clientapp 'x:app' is not in the preloaded package florist" in florist_app.mismatch(
        bundle(tmp_path / "other", other_app)
    )

    def other_server(fab):
        text = (fab / "pyproject.toml").read_text()
        (fab / "pyproject.toml").write_text(
            text.replace('serverapp = "florist.apps.server:app"', 'serverapp = "y:app"')
        )

    other = bundle(tmp_path / "other-server", other_server)
    assert florist_app.mismatch(other) is None  # its ClientApp is ours: a SuperNode serves it warm, a SuperLink not
    assert "its serverapp 'y:app' is not in the preloaded package florist" in florist_app.mismatch(other, "serverapp")

    def other_version(fab):
        text = (fab / "pyproject.toml").read_text()
        (fab / "pyproject.toml").write_text(text.replace('version = "0.1.0"', 'version = "9.0.0"'))

    assert "9.0.0" in florist_app.mismatch(bundle(tmp_path / "version", other_version))


def submit(fed: LocalFederation, app: Path, run_config: str) -> subprocess.CompletedProcess:
    command = [*fed.run_command({})[:2], str(app), *fed.run_command({})[3:-2], "--run-config", run_config]
    return subprocess.run(command, env=fed.env, capture_output=True, text=True, timeout=600)


def test_an_app_that_is_not_florist_runs_in_flowers_own_process(tmp_path):
    with LocalFederation(tmp_path, [{"partition-id": 0, "num-partitions": 1}]) as fed:  # warm, preloading florist
        # Not florist's bundle (its hash is not the one built from the checkout): every round in Flower's process.
        done = submit(fed, APPS / "tinyapp", "rounds=2")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert done.stdout.count("tinyapp: 1 of 1 nodes replied") == 2
        log = (fed.logs / "supernode-0.log").read_text()
    assert "not the preloaded app's bundle" in log
    assert started_tasks(log) == ["stock", "stock"]


def test_a_handler_that_raises_or_hangs_leaves_its_node_serving_the_next_round(tmp_path):
    configs = [{"partition-id": i, "num-partitions": 3, "state-dir": str(tmp_path / "state")} for i in range(3)]
    configs[1]["fault"], configs[2]["fault"] = "raise@2", "hang@2"  # faultyapp/apps.py
    configs[0]["torch-threads"] = 2  # set in each forked child; the executor forks only while it has one thread
    fed = LocalFederation(tmp_path, configs, preload="faultyapp.apps:client")
    fed.env["PYTHONPATH"] = os.pathsep.join([str(APPS / "faultyapp"), fed.env.get("PYTHONPATH", "")])
    with fed:
        node_pids = [node.pid for node in fed.nodes]
        done = submit(fed, APPS / "faultyapp", f'round-timeout={EXPIRY} results-dir="{tmp_path / "out"}"')
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert [node.pid for node in fed.nodes] == node_pids and all(node.alive() for node in fed.nodes)
        logs = [(fed.logs / f"supernode-{i}.log").read_text() for i in (1, 2)]
        first = (fed.logs / "supernode-0.log").read_text()
        started = marked("FLWR_HOME", str(fed.flwr_home))
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    failures = {f["node"].split("(")[-1].rstrip(")"): f for f in results["failures"]}
    assert sorted(failures) == ["partition-1", "partition-2"]  # round 2's train, on the faulty nodes only
    assert all(f["round"] == 2 and f["message_type"] == "train" for f in failures.values())
    assert "injected fault" in failures["partition-1"]["reason"]
    assert f"no reply within {EXPIRY:.0f} s" in failures["partition-2"]["reason"]
    assert len(results["rounds"]) == 3 and all(c["accuracy"] is not None for c in results["clients"])
    for log, fault in zip(logs, ("injected fault", "DeadlineExceeded")):
        assert fault in log and "warm" in started_tasks(log.split(fault)[-1])  # served warm afterwards
        assert log.count("warm executor for faultyapp.apps:client") == 1  # by the same executor
    assert started and not marked("FLWR_HOME", str(fed.flwr_home))  # stopping the federation stopped them all
    threads = re.findall(r"ran with (\d+) torch threads", first)
    assert len(threads) >= 7 and set(threads) == {"2"} and set(started_tasks(first)) == {"warm"}


def _forked(fed: LocalFederation) -> list[tuple[int, int]]:
    """(executor PID, node) of each SuperNode's executor the fork server has forked, in order."""
    log = (fed.logs / "fork-server.log").read_text()
    return [
        (int(pid), fed.node_ports.index(int(port)))
        for pid, port in re.findall(r"executor (\d+) forked for [\d.]+:(\d+)", log)
        if int(port) in fed.node_ports
    ]


def test_a_forked_executor_is_known_refused_when_the_fork_server_closes_without_forking(tmp_path):
    """A SuperNode asks without waiting for the answer (it connects meanwhile); a refusal is what
    sends it to start an executor of its own."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s"))
    listener.listen(2)
    with listener:
        refused = forkserver.request(str(tmp_path / "s"), ["--runtime-api-address", "127.0.0.1:1"], sys.stderr.fileno())
        listener.accept()[0].close()  # what the fork server does with a request it cannot serve
        served = forkserver.request(str(tmp_path / "s"), ["--runtime-api-address", "127.0.0.1:1"], sys.stderr.fileno())
        connection = listener.accept()[0]
        connection.sendall(b"4242\n")
        assert served.poll() is None and served.pid == 4242  # answered, its lifeline held
        connection.close()
    assert refused.wait(5) == 0 and refused.refused
    assert served.wait(5) == 0 and not served.refused


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except FileNotFoundError:
        return None


def _until(condition, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.2)
    return condition()


def test_one_fork_server_preloads_for_every_node_and_forks_an_executor_again_when_one_dies(tmp_path):
    with LocalFederation(tmp_path, node_configs(2, tmp_path)) as fed:
        assert _until(lambda: len(_forked(fed)) == 2)
        executors = dict((node, pid) for pid, node in _forked(fed))
        assert {_parent(pid) for pid in executors.values()} == {fed.fork_server.pid}  # no executor of their own
        assert _parent(fed.server_executor.pid) == fed.fork_server.pid  # nor has the SuperLink
        # Killed once it serves (has said so): killed just after the fork, it would leave no line to count below.
        assert _until(lambda: "forked by the fork server" in (fed.logs / "supernode-0.log").read_text())
        os.kill(executors[0], signal.SIGKILL)
        assert _until(lambda: len(_forked(fed)) == 3), "the SuperNode did not get a new executor"
        assert _forked(fed)[-1][1] == 0
        results = run_submit(fed, tmp_path / "out", **{"num-server-rounds": 1, "local-epochs": 1})
        assert not results["failures"] and results["summary"]["seen"]["num_clients"] == 2
        os.kill(
            fed.server_executor.pid, signal.SIGKILL
        )  # runs must not then wait forever: Flower's SuperExec takes over
        assert _until(lambda: fed.ensure_runs_served() or fed.superexec is not None, 10.0)
        again = run_submit(fed, tmp_path / "again", **{"num-server-rounds": 1, "local-epochs": 1})
        assert not again["failures"] and again["summary"]["seen"]["num_clients"] == 2
        assert "Starting Flower SuperExec" in (fed.logs / "superexec.log").read_text()  # it served the second run
        fed.nodes[1].stop()  # its executor goes with it: the lifeline closed
        assert _until(lambda: _parent(executors[1]) is None, 10.0)
    log = (fed.logs / "supernode-0.log").read_text()
    assert "the warm executor exited" in log and log.count("forked by the fork server") == 2
    assert "preloaded in" not in log  # never preloaded florist itself
    served = (fed.logs / "server-executor.log").read_text()  # the run's ServerApp: forked, not a new process
    assert started_tasks(served) == ["warm"]
    assert "Start `flwr-serverapp` process" not in served and "seen accuracy" in served  # the run's log is there


def test_with_a_wake_pipe_the_executor_asks_for_a_task_quickly_only_after_a_wake_up():
    """The SuperNode takes one message at a time and says when it has pulled one, so between a
    task and the next wake-up only the safety net polls (its cap), not the quick floor; a
    wake-up for a task a poll took already asks for nothing more."""
    from florist.deploy.executor import WarmExecutor

    wake_read, wake_write = os.pipe()
    try:
        executor = WarmExecutor("127.0.0.1:9", PreloadedApp("x:app", "x", {}, None), wake_fd=wake_read)
        polls = executor.polls
        assert polls.delay() == polls.backoff.cap  # nothing pulled yet
        os.write(wake_write, b"!")
        executor.wait()
        assert polls.delay() == polls.backoff.floor  # a message is there: quick until its task is taken
        polls.taken()
        assert polls.delay() == polls.backoff.cap
        polls.taken()  # a poll took the next message's task before the SuperNode said it pulled it
        os.write(wake_write, b"!")
        executor.wait()
        assert polls.delay() == polls.backoff.cap  # that wake-up is for the task taken: no quick polls for nothing
        os.write(wake_write, b"!")
        executor.wait()
        assert polls.delay() == polls.backoff.floor  # the message after it
        plain = WarmExecutor("127.0.0.1:9", PreloadedApp("x:app", "x", {}, None))
        plain.polls.taken()
        assert plain.polls.delay() == plain.polls.backoff.floor  # no wake pipe: polling is all it has
    finally:
        os.close(wake_read)
        os.close(wake_write)
