"""`florist deploy-local`'s run: a real deployment on this machine for one run, a SuperLink and
SuperNodes as processes of their own (`runners/federation.py`), `flwr run`, every process
stopped."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from florist.common.protocol import ESCAPE, one_line
from florist.deploy.bundle import app_dir, bundle_hash
from florist.deploy.federation import LocalFederation
from florist.deploy.netns import Network, check_usable
from florist.deploy.superlink import message_limit
from florist.runners.federation import node_configs
from florist.runners.launch import Events, Federation, Launch
from florist.runners.preflight import configure
from florist.runners.simulation import Interrupted, decode_data
from florist.server.results import note_error


def deploy_local(launch: Launch, federation: Federation, events: Events) -> dict[str, Any]:
    """One run on a federation started for it, stopped after it; returns its results."""
    if federation.netns:
        check_usable()  # before the run's own checks, which take seconds
    checked = configure(launch, events)
    events.started(1, checked.cfg.num_server_rounds)
    # Its nodes read a folder or hub dataset from this machine's data cache: decoded here first, so
    # one refusal names every bad file, before any process starts.
    decode_data(checked.cfg, checked.num_nodes, events)
    num_nodes, results_dir = checked.num_nodes, Path(checked.cfg.results_dir).expanduser().resolve()
    # The ServerApp runs in the federation's folder: paths it is given are absolute.
    tracking = checked.cfg.tracking_dir
    absolute = {"tracking_dir": str(Path(tracking).expanduser().resolve())} if tracking else {}
    # Under SuperNode auth a Flower node id stands for a registered public key: bind node keys to it.
    bind = {"bind_node_keys": True} if federation.auth else {}
    cfg = checked.cfg.replace(results_dir=str(results_dir), **absolute, **bind)
    workdir = Path(federation.state_dir or results_dir / "federation").expanduser().resolve()
    results_file = results_dir / "results.json"
    app = app_dir()  # the bundle submitted below, and the only one its SuperNodes run
    given_mb = federation.max_message_mb
    try:
        # The network is made first and removed last, with whatever still runs in it.
        with (
            Network.for_federation(num_nodes) if federation.netns else contextlib.nullcontext() as network,
            LocalFederation(
                workdir,
                node_configs(num_nodes, workdir),
                tls=federation.tls,
                auth=federation.auth,
                persistent=federation.auth,  # node ids, to which node keys are bound, survive a --resume
                executor=federation.executor,
                network=network,
                trust_apps=[bundle_hash(app)],
                max_message_bytes=int(given_mb * 2**20) if given_mb else message_limit(checked.model_bytes),
            ) as fed,
        ):
            events.federation(fed.describe(submit=False))
            if not cfg.resume_from:
                results_file.unlink(missing_ok=True)
            else:  # why the last attempt stopped is not why this one might
                note_error(str(results_dir), None)
            rc, error = stream(fed.run_command(cfg.to_mapping(), app), fed.env, workdir)
    except KeyboardInterrupt:
        saved = json.loads(results_file.read_text()) if results_file.exists() else None
        raise Interrupted(saved, results_dir) from None
    if rc != 0 or not results_file.exists():
        raise RuntimeError(no_results(rc, error, workdir / "logs"))
    results = json.loads(results_file.read_text())
    if not results.get("complete"):  # Flower's `flwr run` exits 0 when the ServerApp raised
        raise RuntimeError(results.get("error") or f"the run stopped before its end; logs in {workdir / 'logs'}")
    return results


ERROR = "florist: error: "  # how the ServerApp logs a stop it explains (apps/server.py's OneLineStops)


def stream(command: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str | None]:
    """Run `flwr run --stream`, echoing its log to stdout (plain where that is no terminal: a log
    file); its exit status, and the last stop the ServerApp explained in its log (None without
    one), which `flwr run` does not tell by its status."""
    error, plain = None, not sys.stdout.isatty()
    with subprocess.Popen(
        command,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    ) as run:
        try:
            for line in run.stdout:
                sys.stdout.write(ESCAPE.sub("", line) if plain else line)  # Flower colours whatever it logs to
                sys.stdout.flush()
                if ERROR in line:
                    error = one_line(line[line.index(ERROR) + len(ERROR) :])
        except BaseException:  # Ctrl-C: the run goes with the federation
            run.kill()
            raise
    return run.returncode, error


def no_results(rc: int, error: str | None, logs: Path) -> str:
    """Why a run left no results.json, in one line: the ServerApp's own words where its log had
    them. `flwr run` exits 0 even when the ServerApp raised, so its status alone says nothing."""
    if rc != 0:
        return f"`flwr run` exited {rc}: {error or 'see its output above'}; logs in {logs}"
    if error:
        return error
    return f"the ServerApp stopped before it saved any results (its log is above); logs in {logs}"
