"""Who is in a federation: the public keys of a certificates folder registered with the SuperLink
in one go, and the SuperLink's registered SuperNodes listed by the florist names of their keys.
`flwr supernode list` shows numeric node ids and an owner `none`; the SuperLink also holds each
node's public key, matched here against the `*.pub` files by fingerprint (as `ssh-keygen -l`
prints it), so an operator sees which box is which, whether it is online and when it was last."""

from __future__ import annotations

import base64
import dataclasses
import datetime
import hashlib
import json
import os
import re
import subprocess
import tomllib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from florist.common import flower_internals
from florist.deploy.spawning import flower_bin, flower_env

CONTROL_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Connection:
    """A `flwr` CLI connection (`[superlink.NAME]` in `$FLWR_HOME/config.toml`): its Control API."""

    name: str
    address: str
    root_certificates: str | None  # None: insecure


@dataclasses.dataclass(frozen=True)
class Registered:
    """A SuperNode the SuperLink knows: `public_key` as it stores it (PEM), `name` as registered."""

    node_id: int
    status: str  # registered (never connected), online, offline
    last_seen: str  # "now", a UTC time, or "never"
    fingerprint: str  # "" when this Flower does not list keys
    name: str = ""


def connection(name: str | None) -> Connection:
    """The `flwr` connection `name` (None: the config's default), read as `flwr` reads it."""
    home = Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr")
    path = home / "config.toml"
    try:
        superlinks = tomllib.loads(path.read_text()).get("superlink", {})
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist: add the SuperLink's connection there first") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path} is not valid TOML ({err})") from None
    name = name or superlinks.get("default")
    entry = superlinks.get(name) if name else None
    if not isinstance(entry, dict) or "address" not in entry:
        known = sorted(k for k, v in superlinks.items() if isinstance(v, dict))
        raise ValueError(f"no connection {name!r} with an address in {path} (it has: {', '.join(known) or 'none'})")
    certificates = entry.get("root-certificates")
    return Connection(name, entry["address"], None if entry.get("insecure") else certificates)


def fingerprint(public_key: bytes) -> str:
    """`SHA256:...` of a public key given as OpenSSH text (a `.pub` file) or PEM (the SuperLink's
    copy): the same text `ssh-keygen -lf KEY.pub` prints, whichever form it comes in."""
    if public_key.lstrip().startswith(b"-----BEGIN"):
        key = serialization.load_pem_public_key(public_key)
    else:
        key = serialization.load_ssh_public_key(public_key.strip())
    blob = base64.b64decode(
        key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).split()[1]
    )
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def public_keys(folders: Iterable[Path]) -> dict[str, Path]:
    """The `*.pub` files in each folder and its `keys/` (what `florist certs` writes), by fingerprint.
    One that is not a public key is named; two names for one key would make the listing lie."""
    found: dict[str, Path] = {}
    for folder in folders:
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"--certs {folder}: no such folder")
        for path in sorted([*Path(folder).glob("*.pub"), *Path(folder).glob("keys/*.pub")]):
            try:
                key = fingerprint(path.read_bytes())
            except (ValueError, UnsupportedAlgorithm) as err:
                raise ValueError(f"{path} is not an OpenSSH public key ({err}): move it out of the folder") from None
            if key in found and found[key].stem != path.stem:
                raise ValueError(f"{found[key]} and {path} are the same key under two names: keep one")
            found[key] = path
    return found


def register_keys(folders: Sequence[Path], conn: Connection) -> Iterator[str]:
    """`flwr supernode register KEY.pub CONNECTION --name NAME` for every public key in `folders`,
    one line each as it is done (a failure then says which came before); a key the SuperLink
    already has is fine (it keeps its node id)."""
    keys = public_keys(folders)
    if not keys:
        raise FileNotFoundError(f"no *.pub in {', '.join(map(str, folders))} (nor in their keys/)")
    for path in keys.values():
        done = _flwr(["supernode", "register", str(path), conn.name, "--name", path.stem])
        said = done.stdout + done.stderr
        if done.returncode == 0 and (node := re.search(r"SuperNode (\d+) registered", said)):
            yield f"{path.stem}: registered, node id {node.group(1)}"
        elif "already in use" in said:
            yield f"{path.stem}: already registered"
        else:
            last = [line.strip() for line in said.splitlines() if line.strip()][-1:] or [f"exit {done.returncode}"]
            raise RuntimeError(f"registering {path} with {conn.name!r} ({conn.address}) failed: {last[0]}")


def _flwr(args: list[str]) -> subprocess.CompletedProcess:
    """`flwr ARGS`, its output captured; a SuperLink that does not answer in time is one line."""
    try:
        return subprocess.run(
            [flower_bin("flwr"), *args], env=flower_env(), capture_output=True, text=True, timeout=CONTROL_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`flwr {' '.join(args[:2])}` got no answer within {CONTROL_TIMEOUT_S:.0f} s") from None


def _when(iso: str | None) -> str:
    if not iso:
        return "never"
    return datetime.datetime.fromisoformat(iso).astimezone(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _last_seen(status: str, went_offline: str | None) -> str:
    return "now" if status == "online" else _when(went_offline)


def registered_nodes(conn: Connection) -> list[Registered]:
    """Every SuperNode the SuperLink lists (unregistered ones left out), with its key's
    fingerprint: asked through the Control API's client (what `flwr supernode list` asks, whose
    output leaves the keys out), or off the fast path from `flwr supernode list`, without keys."""
    if not flower_internals.fast_path():
        return _registered_nodes_cli(conn)
    import httpx

    try:
        listed = flower_internals.node_infos(conn.address, conn.root_certificates)
    except (httpx.HTTPError, ValueError) as err:  # unreachable, refused, or not a SuperLink
        raise RuntimeError(
            f"the SuperLink's Control API at {conn.address} (connection {conn.name!r}) did not answer: {err}"
        ) from None
    return [
        Registered(
            n.node_id,
            n.status,
            _last_seen(n.status, n.last_deactivated_at),
            fingerprint(n.public_key) if n.public_key else "",
            n.name,
        )
        for n in listed
        if n.status != "unregistered"
    ]


def _registered_nodes_cli(conn: Connection) -> list[Registered]:
    done = _flwr(["supernode", "list", conn.name, "--format", "json"])
    try:
        listed = json.loads(done.stdout)["nodes"]
    except (ValueError, KeyError):
        said = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()][-1:]
        raise RuntimeError(
            f"`flwr supernode list {conn.name}` failed: {said[0] if said else done.returncode}"
        ) from None
    return [
        Registered(int(n["node-id"]), n["status"], _last_seen(n["status"], n.get("offline-at")), "")
        for n in listed
        if n["status"] != "unregistered"
    ]


def node_table(nodes: Sequence[Registered], keys: dict[str, Path]) -> list[list[str]]:
    """One row per registered node, by name, then one per key in `keys` that no node has (when the
    nodes' keys are known: not from Flower's CLI): name,
    node id, fingerprint, status, last seen. A node's name is its key file's, else the name it was
    registered under, else "?"."""
    named = sorted(
        ((keys[n.fingerprint].stem if n.fingerprint in keys else n.name or "?", n) for n in nodes),
        key=lambda pair: (pair[0], pair[1].node_id),
    )
    rows = [[name, str(n.node_id), n.fingerprint or "?", n.status, n.last_seen] for name, n in named]
    listed = {n.fingerprint for n in nodes}
    if nodes and not any(listed):  # Flower's CLI gave no keys: which of them is registered is unknown
        return rows
    return rows + [[path.stem, "-", key, "not registered", "never"] for key, path in keys.items() if key not in listed]
