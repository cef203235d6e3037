"""Run florist in Flower's simulation runtime (Ray runs the clients): `florist simulate`'s run
(`run`: the checks, the data decoded, the run in its runtime), in this process (`simulate`) or in
a child process that Ctrl-C stops at once (`simulate_in_child`); `run_simulated` also runs the
in-process runtime, for `simulate` and `compare` alike."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from florist.common import scenarios, storage
from florist.common.badfiles import refuse_all
from florist.common.hub import hub_client
from florist.common.processes import terminate_marked
from florist.config import RunConfig
from florist.runners import inprocess, raycluster
from florist.runners.launch import Events, Launch
from florist.runners.preflight import configure

MARKER = "FLORIST_RUN"  # in the environment of the child and of every Ray process it starts
# Ray 2.x turns a node address of 127.0.0.1 into this machine's network address, and its GCS,
# raylet, object manager and workers then listen on every interface, unless it is told that it
# runs no cluster (`ray._private.services.get_node_ip_address`; the variable is the one Ray reads
# on Windows and macOS, where that is its default). Then each listens on 127.0.0.1 only.
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class Interrupted(KeyboardInterrupt):
    """The run was stopped by Ctrl-C or SIGTERM; the message says how far it got (`results`:
    what it had saved, or None) and where that is."""

    def __init__(self, results: dict[str, Any] | None, folder: Path):
        rounds = len(results["rounds"]) if results else 0
        resume = f" (go on with --resume {folder})" if rounds else ""
        super().__init__(f"interrupted after {rounds} round{'s' * (rounds != 1)}; results in {folder}{resume}")


class _DropDeprecation(logging.Filter):
    """`run_simulation` warns that it is deprecated in favour of `flwr run`; florist offers
    both (see the README), so the warning says nothing actionable to a florist user."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "run_simulation" not in record.getMessage()


@contextlib.contextmanager
def _without_deprecation_warning() -> Iterator[None]:
    from flwr.common.logger import FLOWER_LOGGER

    drop = _DropDeprecation()
    FLOWER_LOGGER.addFilter(drop)
    try:
        yield
    finally:
        FLOWER_LOGGER.removeFilter(drop)


def client_resources(cpus: float = 1.0, gpus: float | None = None, cluster: bool = False) -> dict[str, Any]:
    """Ray's resources for one simulated client (`--cpus-per-client`, `--gpus-per-client`;
    fractions share a core or GPU between clients). `gpus` None: `raycluster.GPU_SHARE` of a GPU where
    torch sees one, none elsewhere. A ValueError where this machine cannot give them: Ray would
    wait for them forever. On a `cluster` this machine's cores and GPUs say nothing: `gpus`
    stays None and both are fitted to the cluster's nodes once connected (`raycluster.fit`)."""
    if not cpus > 0:
        raise ValueError(f"--cpus-per-client must be > 0, got {cpus}")
    if gpus is not None and not gpus >= 0:
        raise ValueError(f"--gpus-per-client must be >= 0, got {gpus}")
    if cluster:
        return {"num_cpus": cpus, "num_gpus": gpus}
    cores = os.cpu_count() or 1
    if cpus > cores:
        raise ValueError(f"--cpus-per-client must be in (0, {cores}] (this machine's cores), got {cpus}")
    if gpus != 0:
        count = gpu_count()
        if gpus is None:
            gpus = raycluster.GPU_SHARE if count else 0.0
        elif gpus > count:
            raise ValueError(f"--gpus-per-client {gpus}: torch sees {count} GPU(s) on this machine")
    return {"num_cpus": cpus, "num_gpus": gpus}


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def simulate(
    cfg: RunConfig,
    num_nodes: int,
    on_round=None,
    client_app=None,
    resources: dict[str, Any] | None = None,
    address: str | None = None,
) -> dict[str, Any]:
    """Run `cfg` on `num_nodes` simulated SuperNodes, each given `resources` (by default
    `client_resources()`); return the parsed results.json. A client's torch uses as many
    threads as it has CPUs, unless `torch-threads` says otherwise. Without an `address` Ray is
    this machine's and listens on loopback only; with one, the clients run on that cluster
    (`runners/raycluster.py`)."""
    if not address:
        local_ray()  # before Ray is imported
    from flwr.simulation import run_simulation

    from florist.apps.client import app as default_client_app
    from florist.apps.server import make_server_app
    from florist.client.guard import TRUSTED_SERVER_ENV, trusted_server_in_environment
    from florist.common.flower_internals.simulation import quick_pickup

    if num_nodes < cfg.min_nodes:
        raise ValueError(f"num-clients ({num_nodes}) must be at least min-nodes ({cfg.min_nodes})")
    resources = resources or client_resources(cluster=bool(address))
    with _without_deprecation_warning(), trusted_server_in_environment():  # the user's own clients (client/guard.py)
        if address:  # the cluster's workers have their raylet's environment, not this one: they get the variable
            resources = raycluster.join(init_args(0, address), cfg, resources, {TRUSTED_SERVER_ENV: "1"})
        quick_pickup()  # each exchange's messages reach the clients at once, not at the engine's next 0.1 s look
        run_simulation(
            server_app=make_server_app(cfg.to_mapping(), on_round),
            client_app=client_app or default_client_app,
            num_supernodes=num_nodes,
            backend_config={
                "client_resources": resources,
                "init_args": init_args(gpu_count() if resources["num_gpus"] and not address else 0, address),
            },
        )
    return json.loads((Path(cfg.results_dir).expanduser() / "results.json").read_text())


def init_args(num_gpus: int, address: str | None = None) -> dict[str, Any]:
    """`ray.init`'s arguments: a local Ray of this machine's cores and `num_gpus` GPUs, on
    loopback (with `local_ray()`), or with `address`, a connection to a running cluster, which
    keeps its own resources and addresses."""
    quiet = {"logging_level": "ERROR", "log_to_driver": False}
    if address:
        return quiet | {"address": address}
    # No dashboard: it would listen too, and nothing here reads it.
    return quiet | {"num_cpus": os.cpu_count() or 1, "num_gpus": num_gpus, "include_dashboard": False}


def local_ray() -> None:
    """Make the Ray this process starts, and every process that starts, listen on loopback only
    (`LOCAL_RAY_ENV`, inherited by every Ray process). Ray reads the variable when it is first
    imported, so where that was before, its constant is set too. Not for `init_args(address=...)`:
    a cluster spans machines."""
    os.environ.update(LOCAL_RAY_ENV)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


def simulate_in_child(
    cfg: RunConfig,
    num_nodes: int,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    resources: dict[str, Any] | None = None,
    address: str | None = None,
) -> dict[str, Any]:
    """`simulate` in a child process in a session of its own, so that Ctrl-C (KeyboardInterrupt
    here) stops it and every Ray process it started within seconds: the ServerApp runs in a
    thread no signal reaches, and Ray's own shutdown can take half a minute. Progress comes from
    the results.json the ServerApp rewrites after every round; the child's output (Ray's
    included) goes to RESULTS_DIR/simulation.log, and its error, if any, is raised here as one
    line. On Ctrl-C, raises `Interrupted` with the rounds saved so far.

    On the cluster at `address` the child is a driver and started none of Ray's processes: the
    cluster's workers are its raylets' children and do not carry the child's marker, so Ctrl-C
    stops the driver alone, and Ray ends the actors it owned; the cluster keeps running."""
    folder = Path(cfg.results_dir).expanduser().absolute()
    folder.mkdir(parents=True, exist_ok=True)
    results_file, log_path, token = folder / "results.json", folder / "simulation.log", secrets.token_hex(8)
    if not cfg.resume_from:  # a resumed run goes on from what is there
        results_file.unlink(missing_ok=True)
    resources = resources or client_resources(cluster=bool(address))
    settings = [json.dumps(cfg.to_mapping()), str(num_nodes), json.dumps(resources), address or ""]
    command = [sys.executable, "-m", __name__, *settings]
    with storage.open_log(log_path) as log_file:
        child = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=os.environ | {MARKER: token},
            start_new_session=True,
        )
    shown = 0

    def report_new_rounds() -> None:
        nonlocal shown
        for row in (_read(results_file) or {"rounds": []})["rounds"][shown:]:
            shown += 1
            if on_round:
                on_round(row)

    try:
        while child.poll() is None:
            time.sleep(0.2)
            report_new_rounds()
        report_new_rounds()  # the rounds saved between the last look and the end
    except KeyboardInterrupt:
        terminate_marked(MARKER, token, [child.pid], grace=2.0, quiet=1.0)  # Ray forks while it stops
        raise Interrupted(_read(results_file), folder) from None
    if child.returncode != 0:
        lines = log_path.read_text(errors="replace").splitlines()
        error = next((line for line in reversed(lines) if line.startswith("florist: error: ")), None)
        reason = (
            error.removeprefix("florist: error: ") if error else f"the simulation exited with status {child.returncode}"
        )
        raise RuntimeError(f"{reason} (full log: {log_path})")
    return json.loads(results_file.read_text())


def require_ray(runtime: str) -> None:
    """Ray is an extra (a box that joins a federation needs none of it): without it, the
    simulation runtime stops before any work, in one line that names both ways on."""
    if runtime != "in-process" and importlib.util.find_spec("ray") is None:
        raise RuntimeError(
            "the simulation runtime needs Ray, which is not installed: pip install 'florist[simulation]' "
            "(in florist's clone: pip install '.[simulation]'), or run with --runtime in-process"
        )


def run(launch: Launch, events: Events) -> dict[str, Any]:
    """`florist simulate`: one run on simulated nodes, in the launch's runtime, from the command
    line's `Launch` to its results: the run config and the preflight (`configure`), the data
    decoded, the run."""
    require_ray(launch.runtime)
    address = raycluster.address_of(launch.ray_address, launch.runtime)
    checked = configure(
        beside_results(launch, address), events, devices_here=not address
    )  # a Ray cluster's nodes have devices of their own
    resources = client_resources(launch.cpus_per_client, launch.gpus_per_client, cluster=bool(address))
    cfg = checked.cfg
    events.started(1, cfg.num_server_rounds)
    decode_data(cfg, checked.num_nodes, events)
    events.run(cfg.strategy, cfg.seed, reused=False)
    return run_simulated(launch.runtime, cfg, checked.num_nodes, events.round, resources, address)


def beside_results(launch: Launch, address: str | None) -> Launch:
    """The launch with its nodes' models kept beside its results (`models-root` =
    RESULTS_DIR/nodes), as compare's runs keep theirs, unless it names a models-root: not on a
    Ray cluster, whose machines keep them in their own state folders, nor when it resumes a run
    (whose config says where)."""
    if "models-root" in launch.values or launch.resume or address:
        return launch
    results = launch.values.get("results-dir", RunConfig.__dataclass_fields__["results_dir"].default)
    nodes = Path(results).expanduser().absolute() / "nodes"
    return dataclasses.replace(launch, values={**launch.values, "models-root": str(nodes)})


def decode_data(cfg: RunConfig, num_nodes: int, events: Events) -> None:
    """Decode every node's partition of a Hugging Face or folder dataset into the data cache
    before the nodes start (they then read it in milliseconds), told to `events`; nothing for
    the embedded datasets. Every partition is decoded before any bad image file is refused, so
    one refusal names the bad files of the whole dataset, not those of the first partition
    that holds one (each further run would find the next)."""
    if scenarios.parse_dataset(cfg.dataset)[0] != "hub":
        return
    events.decoded(0, num_nodes)

    def decode(pid: int) -> None:
        hub_client(pid, num_nodes, cfg, report=functools.partial(events.decoding, pid))
        events.decoded(pid + 1, num_nodes)

    refuse_all(functools.partial(decode, pid) for pid in range(num_nodes))


def run_simulated(
    runtime: str, cfg: RunConfig, num_nodes: int, on_round, resources: dict[str, Any], address: str | None = None
) -> dict[str, Any]:
    """One run in `runtime` (with `address`, on that Ray cluster); returns its results."""
    require_ray(runtime)
    if runtime == "in-process":
        logging.getLogger("flwr").setLevel(logging.WARNING)  # the progress display says how far it got
        return inprocess.run_in_process(cfg, num_nodes, on_round=on_round, cpus_per_client=resources["num_cpus"])
    return simulate_in_child(cfg, num_nodes, on_round, resources, address)


def _read(results_file: Path) -> dict[str, Any] | None:
    try:
        return json.loads(results_file.read_text())
    except (OSError, json.JSONDecodeError):  # not written yet (it is replaced atomically once it is)
        return None


def _main(argv: list[str]) -> int:
    """The child of `simulate_in_child`: argv = [run config as JSON, number of clients,
    client resources as JSON, the Ray cluster's address or ""]."""
    try:
        cfg, resources = RunConfig.from_mapping(json.loads(argv[0])), json.loads(argv[2])
        simulate(cfg, int(argv[1]), resources=resources, address=argv[3] or None)
    except Exception as err:  # the parent shows this line; the traceback stays in the log
        import traceback

        traceback.print_exc()
        print(f"florist: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
