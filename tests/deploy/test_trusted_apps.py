"""A box runs only the app bundles it trusts (`florist supernode --trust-app`), between real
processes: a SuperLink that submits another bundle gets an error reply naming it, and nothing of
that bundle reaches the box's disk or runs there; the trusted bundle runs as before."""

import hashlib
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from processes import RUN, node_configs, started_tasks

from florist.cli import main
from florist.common.flower_internals import apptrust
from florist.deploy.bundle import TrustedApps, app_dir, bundle_hash
from florist.deploy.federation import LocalFederation
from florist.deploy.join import supernode_args

CLIENT = """import pathlib

pathlib.Path({marker!r}).write_text("imported")  # any code of this bundle that runs on a box leaves this file

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    pathlib.Path({marker!r}).write_text("ran")
    return Message(RecordDict({{"m": MetricRecord({{"ok": 1}})}}), reply_to=msg)
"""

SERVER = """import time

from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    deadline = time.monotonic() + 60
    while not (nodes := list(grid.get_node_ids())) and time.monotonic() < deadline:
        time.sleep(0.5)
    messages = [Message(RecordDict(), dst_node_id=node, message_type="query") for node in nodes]
    for reply in grid.send_and_receive(messages, timeout=60):
        node = reply.metadata.src_node_id  # the node made this error reply itself, so it names it
        if reply.has_error():
            print(f"foreign: node {node} refused it: {reply.error.code} {reply.error.reason}", flush=True)
        else:
            print(f"foreign: node {node} ran it", flush=True)
"""

PYPROJECT = """[build-system]
requires = ["hatchling==1.27.0"]
build-backend = "hatchling.build"

[project]
name = "foreignapp"
version = "1.0.0"

[tool.flwr.app]
publisher = "someone-else"

[tool.flwr.app.components]
serverapp = "foreignapp.server:app"
clientapp = "foreignapp.client:app"
"""


def foreign_app(folder: Path, marker: Path) -> Path:
    """A Flower app that is not florist, whose ClientApp leaves `marker` as soon as it is imported."""
    (folder / "foreignapp").mkdir(parents=True)
    (folder / "pyproject.toml").write_text(PYPROJECT)
    (folder / "foreignapp" / "__init__.py").write_text("")
    (folder / "foreignapp" / "client.py").write_text(CLIENT.format(marker=str(marker)))
    (folder / "foreignapp" / "server.py").write_text(SERVER)
    return folder


def flwr_run(fed: LocalFederation, app: Path, run_config: dict) -> subprocess.CompletedProcess:
    return subprocess.run(fed.run_command(run_config, app), env=fed.env, capture_output=True, text=True, timeout=600)


def test_a_box_refuses_a_bundle_it_does_not_trust_before_any_of_it_runs(tmp_path):
    stage = app_dir()  # submitted below as it is now, whatever changes in the checkout meanwhile
    florist, marker = bundle_hash(stage), tmp_path / "marker"
    foreign = foreign_app(tmp_path / "foreign", marker)
    foreign_hash = bundle_hash(foreign)
    with LocalFederation(tmp_path / "fed", node_configs(1, tmp_path), trust_apps=[florist]) as fed:
        [node_id] = fed.online_nodes()
        done = flwr_run(fed, foreign, {})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert f"foreign: node {node_id} refused it: 7 app bundle {foreign_hash} refused" in done.stdout, done.stdout
        log = (fed.logs / "supernode-0.log").read_text()
        assert not marker.exists()  # not imported, not run, by any process on the box
        refusals = [line for line in log.splitlines() if "refused app bundle" in line]
        assert len(refusals) == 1 and f"--trust-app {foreign_hash}" in refusals[0], refusals
        assert "Start `flwr-clientapp` process" not in log and not started_tasks(log)  # no task was made of it
        results = tmp_path / "out"
        config = RUN | {"min-nodes": 1, "num-server-rounds": 1, "local-epochs": 1, "results-dir": str(results)}
        done = flwr_run(fed, stage, config)  # the trusted bundle, on the same box
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((results / "results.json").read_text())
    assert summary["complete"] and not summary["failures"] and summary["summary"]["seen"]["num_clients"] == 1
    log = (fed.logs / "supernode-0.log").read_text()
    assert "no --trust-app given" not in log and log.count("refused app bundle") == 1
    assert started_tasks(log) and "foreignapp" not in log


def test_a_bundle_is_checked_against_the_hash_it_was_announced_with():
    """A SuperLink that announces a trusted hash and sends other bytes is refused too."""
    trusted = hashlib.sha256(b"trusted bundle").hexdigest()
    judge = TrustedApps.parse([trusted.upper()])
    assert judge(trusted) is None and judge("0" * 64) is not None
    fetched = []

    def get_fab(fab_hash, run_id):
        fetched.append(fab_hash)
        return SimpleNamespace(content=b"something else")

    get_checked_fab = apptrust._checked(get_fab, judge)
    with pytest.raises(apptrust.Refused, match="does not match the hash it was announced with"):
        get_checked_fab(trusted, 1)
    with pytest.raises(apptrust.Refused, match="runs only the apps its operator trusts"):
        get_checked_fab("0" * 64, 1)
    assert fetched == [trusted]  # an untrusted bundle is not even fetched
    assert apptrust.problems() == []  # the pinned Flower reads as the gate expects


def test_trust_app_flags_are_checked_and_passed_on(tmp_path, capsys):
    assert main(["supernode", "--trust-app", "abc", "--insecure"]) == 2
    assert "--trust-app 'abc': expected the 64 hex digits" in capsys.readouterr().err
    sha = "ab" * 32
    args = supernode_args(
        "127.0.0.1:9092",
        tmp_path,
        root_certificates=None,
        auth_key=None,
        state_dir=None,
        node_key="box",
        max_wait_time=5,
        trust_apps=[sha],
    )
    assert args[args.index("supernode") :][-1] == f"--trust-app={sha}"
    assert main(["app-hash", str(app_dir())]) == 0
    assert capsys.readouterr().out.strip() == bundle_hash(app_dir())
