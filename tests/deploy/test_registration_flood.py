"""An anonymous party cannot fill `florist superlink --insecure` with registrations (issue 53):
its nodes are capped by --max-nodes, registrations that never connect expire, keys larger than
a real one are refused, and the log grows by a line a minute, not a line per call."""

import json
import logging
import os
import socket
import subprocess
import sys
import time

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from fleet_flood import register_all, status_mib
from processes import node_configs, submit

from florist.common.flower_internals.registrations import LOG_CHARS, OneLineRemote, PeerRate, address
from florist.deploy.certs import make_node_key
from florist.deploy.federation import LocalFederation
from florist.deploy.spawning import flower_env, free_port
from florist.deploy.superlink import open_fleet

MAX_NODES, EXPIRY, FLOOD = 50, 3.0, 2_000


def _real_key() -> bytes:
    """A public key as Flower's SuperNode registers one: P-384, PEM SubjectPublicKeyInfo."""
    public = ec.generate_private_key(ec.SECP384R1()).public_key()
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _wait_for(port: int, process: subprocess.Popen, log, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"no SuperLink on port {port}")


def _live_nodes(env: dict) -> list[dict]:
    listed = subprocess.run(
        ["flwr", "supernode", "list", "flood", "--format", "json"], env=env, capture_output=True, text=True
    )
    assert listed.returncode == 0, listed.stdout + listed.stderr
    nodes = json.loads(listed.stdout)["nodes"]
    return [n for n in nodes if n["status"] in ("registered", "online", "offline")]


def test_a_registration_flood_leaves_at_most_max_nodes_and_a_short_log_and_a_real_key_registers(tmp_path):
    fleet, control = free_port(), free_port()
    env = flower_env(tmp_path / "home")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "config.toml").write_text(
        f'[superlink]\ndefault = "flood"\n\n[superlink.flood]\naddress = "127.0.0.1:{control}"\ninsecure = true\n'
    )
    log = tmp_path / "superlink.log"
    args = ["--insecure", "--fleet-api-address", f"127.0.0.1:{fleet}", "--host", "127.0.0.1", "--port", str(control)]
    limits = ["--max-nodes", str(MAX_NODES), "--registration-expiry", str(EXPIRY)]
    with open(log, "wb") as out:
        link = subprocess.Popen(
            [sys.executable, "-m", "florist", "superlink", *limits, *args], stdout=out, stderr=out, env=env
        )
    try:
        _wait_for(fleet, link, log)
        time.sleep(1.0)  # its first lines written
        rss, logged = status_mib(link.pid, "VmRSS"), log.stat().st_size
        stranger, _ = make_node_key(tmp_path / "keys", "stranger")  # any key signs Fleet calls
        keys = [os.urandom(200) for _ in range(FLOOD)] + [b"taken" * 40] * 50 + [os.urandom(600)] * 5
        answers = register_all(f"127.0.0.1:{fleet}", keys, stranger)
        assert answers[-5:] == ["INVALID_ARGUMENT"] * 5  # over the size of any real key
        assert answers.count("RESOURCE_EXHAUSTED") >= FLOOD - answers.count("OK")  # the cap, not an error
        assert len(_live_nodes(env)) <= MAX_NODES
        growth = log.stat().st_size - logged
        assert growth < 64 * 1024, log.read_text()[-3000:]  # a line a minute, not one per call
        assert status_mib(link.pid, "VmRSS") - rss < 64
        time.sleep(EXPIRY)  # the flood's registrations never connected: at the cap, they expire
        assert register_all(f"127.0.0.1:{fleet}", [_real_key()], stranger) == ["OK"]
        assert len(_live_nodes(env)) <= MAX_NODES
        assert "registrations that never connected" in log.read_text()
    finally:
        link.terminate()
        link.wait(timeout=30)


def test_a_remote_address_is_held_to_its_rate_whatever_its_port():
    now = [0.0]
    rate = PeerRate(per_minute=6, clock=lambda: now[0])
    taken = [rate.take(address(f"ipv4:10.0.0.9:{port}")) for port in range(10)]
    assert taken == [True] * 6 + [False] * 4 and rate.take("ipv4:10.0.0.8:1")  # another address has its own
    now[0] = 10.0  # one registration a 10 s
    assert rate.take("ipv4:10.0.0.9") and not rate.take("ipv4:10.0.0.9")


def test_a_fleet_log_line_quoting_a_remote_key_is_cut_to_one_short_line():
    record = logging.LogRecord(
        "flwr", logging.ERROR, "", 0, "[RegisterNode][ApiError:1] key: %r", (b"x\n" * 4000,), None
    )
    assert OneLineRemote().filter(record)
    assert len(record.getMessage()) <= LOG_CHARS and "\n" not in record.getMessage()


def test_an_open_fleet_port_without_node_authentication_is_named():
    assert open_fleet(["--insecure"]) == "0.0.0.0:9092"  # flower-superlink's default Fleet address
    assert open_fleet(["--insecure", "--fleet-api-address", "127.0.0.1:9092"]) is None
    assert open_fleet(["--ssl-certfile", "s.pem", "--enable-supernode-auth"]) is None


def test_a_node_of_the_federation_still_trains_after_a_registration_flood(tmp_path):
    """The flood's registrations never connect: the run samples its online node only."""
    with LocalFederation(tmp_path / "fed", node_configs(1, tmp_path)) as fed:
        stranger, _ = make_node_key(tmp_path / "stranger", "stranger")
        answers = register_all(fed.fleet_address, [os.urandom(200) for _ in range(500)], stranger)
        assert answers == ["OK"] * 500  # under the default --max-nodes
        results = submit(fed, tmp_path / "out", **{"num-server-rounds": 1, "local-epochs": 1})
        assert results["complete"] and results["summary"]["seen"]["num_clients"] == 1
