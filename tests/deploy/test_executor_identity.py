"""What the warm executor runs warm: florist's own app bundle, recognised by its full hash, and
nothing else; a bundle's own modules never shadow an installed one in a warm child. And the
SuperExec auth secret a local federation gives its Runtime APIs and their executors."""

import os
import re
import shutil
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest
from processes import RUN, started_tasks

from florist.common.flower_internals import runtime
from florist.deploy import executor as executor_module
from florist.deploy.bundle import app_dir
from florist.deploy.executor import WarmExecutor
from florist.deploy.federation import CONNECTION, LocalFederation
from florist.deploy.preloaded import PreloadedApp
from florist.deploy.spawning import flower_bin, toml_node_config

# Imported by a rotation of 120° (`scenarios.rotate`), lazily: not preloaded. It records who
# imported it, then hands over to the installed torchvision, so that the run goes on.
SHADOW = """import os, sys
with open({marker!r}, "a") as marker:
    marker.write(f"{{os.getpid()}}\\n")
_here = os.path.realpath(os.path.dirname(os.path.dirname(__file__)))
_path = sys.path[:]
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != _here]
del sys.modules["torchvision"]
try:
    import torchvision
finally:
    sys.path[:] = _path
"""


@pytest.fixture(scope="module")
def florist_app():
    return PreloadedApp.load("florist.apps.client:app")


def _task(fab_hash: str) -> types.SimpleNamespace:
    from flwr.supercore.constant import TaskType

    return types.SimpleNamespace(type=TaskType.CLIENT_APP, fab_hash=fab_hash, task_id=1, run_id=1)


def _install(fab: bytes, flwr_home: Path) -> Path:
    """`fab` installed as Flower's ClientApp runtime installs it."""
    from flwr.cli.install import install_from_fab

    return install_from_fab(fab, install_dir=flwr_home, skip_prompt=True)


def test_a_bundle_is_warm_only_by_its_full_hash_and_only_in_a_folder_holding_exactly_it(
    florist_app, tmp_path, monkeypatch
):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    monkeypatch.setattr(executor_module, "os_threads", lambda: 1)  # pytest's own threads are not the executor's
    executor = WarmExecutor("127.0.0.1:1", florist_app)
    own = florist_app.bundle_hash
    assert own and len(own) == 64 and "pyproject.toml" in florist_app.bundle_files
    other = own[:8] + ("0" if own[8] != "0" else "1") + own[9:]  # the same 8-digit prefix Flower names folders by
    shadow = _install(runtime.fab_bytes(app_dir()), tmp_path)  # Flower names it by 8 digits: the other's name too
    assert executor.why_not_warm(_task(other)) == "not the preloaded app's bundle"
    assert executor.why_not_warm(_task(own)) is None  # the folder holds exactly the bundle (found by prefix)

    (shadow / "torchvision").mkdir()
    (shadow / "torchvision" / "__init__.py").write_text("raise SystemExit('shadowed')\n")
    assert "1 files not in the bundle (torchvision/__init__.py)" in florist_app.holds(shadow)
    assert "does not hold exactly its app bundle" in WarmExecutor("127.0.0.1:1", florist_app).why_not_warm(_task(own))
    assert not executor.holds(other, shadow) and not WarmExecutor("127.0.0.1:1", florist_app).holds(own, shadow)


def test_the_app_folder_stays_off_sys_path_in_a_warm_process(tmp_path, monkeypatch):
    from flwr.supercore import object_ref

    monkeypatch.setattr(object_ref, "_ensure_sys_path", object_ref._ensure_sys_path)  # restored afterwards
    monkeypatch.setattr(sys, "path", sys.path[:])
    assert runtime.keep_app_folders_off_sys_path()
    assert object_ref.load_app("florist.apps.client:app", ValueError, project_dir=tmp_path) is not None
    assert str(tmp_path) not in sys.path


def _submit(fed: LocalFederation, app: Path, results: Path, **overrides) -> subprocess.CompletedProcess:
    config = RUN | {"min-nodes": 1, "results-dir": str(results), "local-epochs": 1} | overrides
    command = [flower_bin("flwr"), "run", str(app), CONNECTION, "--stream", "--run-config", toml_node_config(config)]
    return subprocess.run(command, env=fed.env, capture_output=True, text=True, timeout=600, cwd=fed.workdir)


def _pids(log: str, kind: str) -> set[int]:
    return {int(pid) for pid in re.findall(rf"task \d+ of run \d+: {kind} process (\d+)", log)}


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """One warm node, partition 0 of 3: under `shift="rotate:3"` its cluster's angle is 120°,
    which torchvision rotates (imported then)."""
    root = tmp_path_factory.mktemp("fed")
    with LocalFederation(root, [{"partition-id": 0, "num-partitions": 3, "state-dir": str(root / "state")}]) as fed:
        yield fed


def test_florists_files_plus_a_torchvision_of_its_own_never_run_warm(federation, tmp_path):
    marker = tmp_path / "imported-by"
    shadowing = shutil.copytree(app_dir(), tmp_path / "app")  # florist's exact files, as `flwr run` bundles them
    (shadowing / "torchvision").mkdir()
    (shadowing / "torchvision" / "__init__.py").write_text(SHADOW.format(marker=str(marker)))
    pyproject = (shadowing / "pyproject.toml").read_text()
    include = 'fab-include = ["florist/**/*.py"]'  # the bundle takes only what this names
    assert include in pyproject
    (shadowing / "pyproject.toml").write_text(pyproject.replace(include, include[:-1] + ', "torchvision/**/*.py"]'))
    node_log = federation.logs / "supernode-0.log"
    before = len(node_log.read_text())

    done = _submit(federation, shadowing, tmp_path / "shadowed", shift="rotate:3", **{"num-server-rounds": 2})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = node_log.read_text()[before:]
    assert len(started_tasks(log)) >= 4 and set(started_tasks(log)) == {"stock"}, log[-3000:]
    assert "not the preloaded app's bundle" in log
    imported_by = {int(pid) for pid in marker.read_text().split()}  # Flower's stock process does import it
    assert imported_by and imported_by <= _pids(log, "stock") and not imported_by & _pids(log, "warm")

    before = len(node_log.read_text())
    done = _submit(federation, app_dir(), tmp_path / "own", **{"num-server-rounds": 1})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = node_log.read_text()[before:]
    assert started_tasks(log) and set(started_tasks(log)) == {"warm"}, log[-3000:]


def test_a_local_federations_runtime_apis_serve_tasks_only_to_its_executors(federation, tmp_path):
    secret = federation.auth_secret
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and stat.S_IMODE(secret.parent.stat().st_mode) == 0o700
    assert federation.workdir not in secret.parents and len(secret.read_bytes()) == 32
    wrong = tmp_path / "wrong"
    wrong.write_bytes(os.urandom(32))
    for address in (f"127.0.0.1:{federation.node_ports[0]}", federation.control_address):  # a SuperNode, the SuperLink
        for key in (None, runtime.load_auth_secret(str(wrong))):
            client = runtime.runtime_client(address, None, key)
            with pytest.raises(Exception, match="401 Unauthorized"):
                runtime.acquire_task(client)
    done = _submit(federation, app_dir(), tmp_path / "signed", **{"num-server-rounds": 1})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]  # the executors sign theirs
    assert "signing its task requests" in (federation.logs / "supernode-0.log").read_text()
    assert "signing its task requests" in (federation.logs / "server-executor.log").read_text()


def test_an_unreadable_secret_file_ends_florist_supernode_in_one_line(tmp_path):
    args = ["--superexec-auth-secret-file", str(tmp_path / "missing"), "--insecure", "--superlink", "127.0.0.1:1"]
    done = subprocess.run(
        [sys.executable, "-m", "florist", "supernode", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("florist: error: Failed to read SuperExec auth secret")
