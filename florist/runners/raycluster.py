"""Simulation on a Ray cluster the user started (`florist simulate --ray-address`): the run
joins it as one more driver, refuses early what cannot work there, and leaves it as it found
it. Its clients run in actors of the cluster's raylets, which are not florist's processes:
stopping the run stops its driver, and Ray then ends the actors the driver owned.

What each node needs of its own (Ray ships neither): the same Python environment with florist,
and the run's data. The embedded datasets are in the package; a Hugging Face id is fetched by
each node that runs clients of it; a local folder must lie at the same absolute path on every
node, with the same files. `join` checks each node before the run starts."""

from __future__ import annotations

import hashlib
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import florist
from florist.client import guard
from florist.config import RunConfig

ADDRESS_ENV = "FLORIST_RAY_ADDRESS"  # the cluster when --ray-address is not given
GPU_SHARE = 0.25  # a client's share of a GPU where there is one and --gpus-per-client is not given
FORMS = "HOST:PORT (the head's `ray start --head --port`), ray://HOST:PORT (Ray Client) or auto"
PROBE_SECONDS = 5.0  # a head that does not accept a connection by then is not there: Ray itself would wait minutes
NODE_SECONDS = 120.0  # for each node to start a worker and answer `check_nodes`


def address_of(flag: str | None, runtime: str) -> str | None:
    """The cluster a run joins, checked (`check_address`): `--ray-address` (`flag`), else
    `FLORIST_RAY_ADDRESS`; None for a private local Ray (an empty flag asks for one whatever the
    variable says). The in-process runtime runs no Ray: with the flag that is a mistake, the
    variable it leaves alone."""
    if flag and runtime == "in-process":
        raise ValueError("--ray-address needs --runtime simulation (the in-process runtime runs no Ray)")
    address = flag if flag is not None else os.environ.get(ADDRESS_ENV, "") if runtime != "in-process" else ""
    if address:
        check_address(address)
    return address or None


def check_address(address: str) -> None:
    """Refuse, in one line and within seconds, an address of the wrong form or one where no
    head accepts a connection (`ray.init` would retry for minutes). `auto` is Ray's to find."""
    if address == "auto":
        return
    match = re.fullmatch(r"(?:ray://)?(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d{1,5})", address)
    if not match or not 0 < int(match[2]) < 65536:
        raise ValueError(f"--ray-address {address!r} is not {FORMS}")
    host, port = match[1].strip("[]"), int(match[2])
    try:
        socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise ValueError(
            f"no Ray cluster answers at {address} ({why}): start its head there with `ray start --head "
            f"--port={port}`, or leave --ray-address out for a Ray of this machine's own"
        ) from None


def join(init: Mapping[str, Any], cfg: RunConfig, resources: Mapping[str, float | None], env: Mapping[str, str]):
    """Connect this process to the cluster (`init`: `ray.init`'s arguments) as the run's
    driver, its workers getting `env`; return the client `resources` fitted to the cluster
    (`fit`), once every node is found fit for the run (`check_nodes`). Flower's simulation then
    uses this connection, and ends it when the run ends."""
    import ray

    ray.init(**init, runtime_env={"env_vars": dict(env)})
    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources")]
    fitted = fit(resources, nodes, init["address"])
    check_nodes(cfg, nodes)
    return fitted


def fit(resources: Mapping[str, float | None], nodes: list[dict[str, Any]], address: str) -> dict[str, float]:
    """One client's `resources` on a cluster of `nodes` (`ray.nodes()`'s live ones): GPUs not
    given are `GPU_SHARE` where the cluster has any; a ValueError when no node has enough of
    either for one client, for Ray would wait for them forever."""
    has = [(n["NodeManagerAddress"], n["Resources"].get("CPU", 0), n["Resources"].get("GPU", 0)) for n in nodes]
    cpus, gpus = resources["num_cpus"], resources["num_gpus"]
    if gpus is None:
        gpus = GPU_SHARE if any(gpu for _, _, gpu in has) else 0.0
    if not any(cpu >= cpus and gpu >= gpus for _, cpu, gpu in has):
        listed = "; ".join(f"{ip}: {cpu:g} CPU(s), {gpu:g} GPU(s)" for ip, cpu, gpu in has) or "none"
        raise ValueError(
            f"no node of the Ray cluster at {address} can give a client {cpus:g} CPU(s) and {gpus:g} GPU(s) "
            f"(--cpus-per-client, --gpus-per-client); its nodes: {listed}"
        )
    return {"num_cpus": float(cpus), "num_gpus": float(gpus)}


def check_nodes(cfg: RunConfig, nodes: list[dict[str, Any]]) -> None:
    """Refuse, in one line naming the node, a run that some node of the cluster (`nodes`, as
    `ray.nodes()` lists them) cannot take part in: one that cannot run this florist, or cannot
    read, or holds other files in, a local folder of the run (`dataset`, PerFed-CKT's
    `public-dir`) than this machine does. Without this a node's clients would fail at their
    first message and the run go on without them."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    folders = _folders(cfg)
    probe = ray.remote(num_cpus=0)(report)
    pending = {
        n["NodeManagerAddress"]: probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(list(folders.values()))
        for n in nodes
    }
    here = report(list(folders.values()))
    for ip, answer in pending.items():
        try:
            theirs = ray.get(answer, timeout=NODE_SECONDS)
        except Exception as err:  # Ray's: the node could not load florist's code, or did not answer in time
            first = (str(err).strip().splitlines() or [""])[0]
            raise ValueError(
                f"Ray node {ip} cannot run florist ({type(err).__name__}: {first}): every node needs the same Python "
                "environment with florist installed"
            ) from None
        if theirs["florist"] != here["florist"]:
            raise ValueError(f"Ray node {ip} runs florist {theirs['florist']}, this machine {here['florist']}")
        for (key, path), mine, found in zip(folders.items(), here["folders"], theirs["folders"]):
            if found != mine:
                why = found if isinstance(found, str) else f"it holds {found[0]} files there, this machine {mine[0]}"
                raise ValueError(
                    f"{key} folder {path} cannot be used on Ray node {ip} ({why}): every node needs the same "
                    "files at the same path (or use a Hugging Face dataset id)"
                )


def _folders(cfg: RunConfig) -> dict[str, str]:
    """The run's local folders by setting, each an absolute path (a relative one would be read
    from each node's own working folder)."""
    folders = {"dataset": cfg.dataset} if guard.names_a_folder(cfg.dataset) else {}
    if public := getattr(cfg.settings, "public_dir", ""):
        folders["public-dir"] = public
    for key, path in folders.items():
        if not Path(path).expanduser().is_absolute():
            raise ValueError(f"{key} {path!r}: on a Ray cluster give the folder's absolute path")
    return folders


def report(paths: list[str]) -> dict[str, Any]:
    """What a node says of itself before a run (`check_nodes`): its florist version and the
    `listing` of `paths`."""
    return {"florist": florist.__version__, "folders": listing(paths)}


def listing(paths: list[str]) -> list[tuple[int, str] | str]:
    """Per folder of `paths`, (number of files, hash of their relative names and sizes), or
    why it cannot be read. It runs on every node of the cluster: unlike the data cache's
    fingerprint it leaves out modification times, which a copy to another machine changes."""
    found: list[tuple[int, str] | str] = []
    for path in paths:
        root, lines = Path(path).expanduser(), []
        try:
            for folder, _, files in os.walk(root, onerror=_raise):
                lines += [f"{Path(folder, f).relative_to(root)}\0{os.path.getsize(Path(folder, f))}" for f in files]
        except OSError as err:
            found.append(f"{err.strerror or type(err).__name__} on host {socket.gethostname()}")
            continue
        found.append((len(lines), hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest()))
    return found


def _raise(err: OSError) -> None:
    raise err
