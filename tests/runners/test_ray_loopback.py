"""`florist simulate`'s Ray listens on loopback only: a Ray started with florist's settings
(`simulation.local_ray()`, `simulation.init_args`) in a child process, every listening socket of
every process it started (found by PID under /proc) on 127.0.0.1 or ::1. Ray is stopped by the
child's `ray.shutdown()`; anything of its left after that is stopped here by PID."""

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from florist.runners.simulation import init_args

PROBE = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    if sys.argv[1] == "ray-first":  # Ray imported before florist's settings: its constant is set then
        import ray
    from florist.runners.simulation import init_args, local_ray
    local_ray()
    import ray
    from tests.runners.test_ray_loopback import descendants, listening
    ray.init(**init_args(0))
    try:
        time.sleep(2)  # the worker and agents come up after ray.init returns
        print(json.dumps(listening(descendants(os.getpid()))), flush=True)
    finally:
        ray.shutdown()
    """
)


def descendants(root: int) -> list[int]:
    """`root` and every process below it, read from /proc."""
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(pid))
    found, todo = [], [root]
    while todo:
        found.append(pid := todo.pop())
        todo += children.get(pid, [])
    return found


def _address(hex_address: str) -> str:
    """An address of /proc/net/tcp{,6}: 32-bit words, each in host (little-endian) byte order."""
    words = [bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8)]
    return str(ipaddress.ip_address(b"".join(words)))


def listening(pids: list[int]) -> dict[str, list[str]]:
    """{"PID name": ["address:port", ...]} of the TCP sockets `pids` listen on."""
    sockets = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                address, port = fields[1].split(":")
                sockets[f"socket:[{fields[9]}]"] = f"{_address(address)}:{int(port, 16)}"
    found: dict[str, list[str]] = {}
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if mine := sorted(sockets[link] for link in links if link in sockets):
            found[f"{pid} {name}"] = mine
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


@pytest.mark.parametrize("order", ["florist-first", "ray-first"])
def test_every_ray_process_of_a_local_run_listens_on_loopback_only(order):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ENABLE")} | {"RAY_USAGE_STATS_ENABLED": "0"}
    probe = subprocess.Popen(
        [sys.executable, "-c", PROBE, order],
        cwd=Path(__file__).parents[2],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = probe.communicate(timeout=180)
    finally:
        if probe.poll() is None:  # stuck: stop it and what it started, each by PID
            for pid in reversed(descendants(probe.pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            probe.wait()
    assert probe.returncode == 0, err[-3000:]
    found = json.loads(out.strip().splitlines()[-1])
    names = " ".join(found)
    assert "gcs_server" in names and "raylet" in names, found  # Ray's servers were seen at all
    exposed = {proc: [a for a in addresses if not _loopback(a)] for proc, addresses in found.items()}
    assert not any(exposed.values()), exposed


def test_a_connection_to_a_cluster_gets_none_of_the_local_settings():
    assert init_args(0, address="ray://head:10001") == {
        "logging_level": "ERROR",
        "log_to_driver": False,
        "address": "ray://head:10001",
    }
