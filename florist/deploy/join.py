"""`florist join`: start a SuperNode on an edge box, pointed at its own data folder and at a
running SuperLink, and turn Flower's failure modes into messages that say what to fix."""

from __future__ import annotations

import re
import socket
import sys
import time
from pathlib import Path

from florist.client.state import NodeState
from florist.common import devices
from florist.common.data import ClientData
from florist.common.folders import folder_client
from florist.deploy.spawning import Process, free_port, spawn, supernode_command, toml_node_config

# (patterns in the SuperNode's output, what it means for the user), most specific first
DIAGNOSES = [
    (
        ("CERTIFICATE_VERIFY_FAILED", "certificate signature failure", "SSL/TLS handshake error"),
        "the SuperLink's TLS certificate does not verify against {ca}: wrong CA file, or the certificate was "
        "not issued for the address {superlink} (check the --hosts given to `florist certs`)",
    ),
    (
        ("[code: 2004]",),
        "this node's public key is not registered with the SuperLink. On the SuperLink's "
        "machine run: flwr supernode register {pub} <connection>",
    ),
    (
        ("[code: 2001]",),
        "the SuperLink requires SuperNode authentication: pass --auth-key with a private key "
        "whose .pub is registered there (flwr supernode register KEY.pub <connection>)",
    ),
    (
        ("WRONG_VERSION_NUMBER",),
        "TLS mismatch: the SuperLink speaks TLS but this node was started without "
        "--root-certificates (or the other way round)",
    ),
    (
        ("Connection attempt failed",),
        "cannot reach the SuperLink at {superlink} after retrying for {wait:.0f} s: "
        "check the address, that the SuperLink runs, and that its Fleet port is open to this box",
    ),
]


class JoinError(RuntimeError):
    """The SuperNode could not join; the message says why and what to do."""


def diagnose(output: str, **facts: object) -> str | None:
    """The first known failure found in a SuperNode's output, explained."""
    for patterns, explanation in DIAGNOSES:
        if any(p in output for p in patterns):
            return explanation.format(**facts)
    return None


def tls_mismatch(superlink: str, tls: bool) -> str | None:
    """What is wrong when the SuperLink answers at `superlink` but speaks TLS where this node
    was given no CA, or plain text where it was; None when it matches or does not answer (the
    SuperNode's own retries then tell "unreachable")."""
    import ssl

    host, _, port = superlink.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=3)
    except OSError:
        return None
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # only asking whether it speaks TLS
    context.set_alpn_protocols(["h2"])
    try:
        with context.wrap_socket(sock, server_hostname=host):
            speaks_tls = True
    except (ssl.SSLError, OSError):
        speaks_tls = False
    finally:
        sock.close()
    if speaks_tls and not tls:
        return (
            f"the SuperLink at {superlink} speaks TLS: pass --root-certificates with the CA certificate it was "
            "issued by (ca.crt)"
        )
    if tls and not speaks_tls:
        return (
            f"the SuperLink at {superlink} does not speak TLS (it runs with --insecure): leave out "
            "--root-certificates, or restart it with TLS"
        )
    return None


def supernode_args(
    superlink: str,
    data_dir: Path,
    *,
    root_certificates: Path | None,
    auth_key: Path | None,
    state_dir: Path | None,
    node_key: str,
    max_wait_time: float,
    executor: str = "warm",
    device: str | None = None,
) -> list[str]:
    node_config = {"data-dir": str(data_dir), "node-key": node_key} | (
        {"state-dir": str(state_dir)} if state_dir else {}
    )
    node_config |= {"device": device} if device else {}
    args = [
        *supernode_command(executor),
        "--superlink",
        superlink,
        "--node-config",
        toml_node_config(node_config),
        "--port",
        str(free_port()),
        "--max-wait-time",
        str(max_wait_time),
    ]
    args += ["--root-certificates", str(root_certificates)] if root_certificates else ["--insecure"]
    if auth_key:
        args += ["--auth-supernode-private-key", str(auth_key)]
    return args


def follow(process: Process, log_path: Path) -> str:
    """Echo the process's log while it runs; return all of it once it has exited. (Waiting
    for EOF on a pipe would hang: the SuperNode's SuperExec child inherits it.)"""
    shown = 0
    try:
        while True:
            done = not process.alive()
            text = log_path.read_text(errors="replace")
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
            if done:
                return text
            time.sleep(0.2)
    except KeyboardInterrupt:
        process.stop()
        return log_path.read_text(errors="replace")


def check_locally(
    superlink: str,
    data_dir: Path,
    num_classes: int,
    root_certificates: str | Path | None,
    auth_key: str | Path | None,
    device: str | None,
) -> ClientData:
    """What a box can get wrong before it dials, each in one line: the address, the device, the
    data folder (naming the file), the certificate and key files, TLS on one side only."""
    if not re.fullmatch(r"[^\s:]+:\d+", superlink):
        raise ValueError(f"--superlink must be HOST:PORT (the SuperLink's Fleet API), got {superlink!r}")
    if device:
        devices.resolve(device, "--device")  # a device this machine lacks fails here, not at the first message
    client = folder_client(data_dir, num_classes, seed=0, val_fraction=0.15)
    files = {"--root-certificates": root_certificates, "--auth-key": auth_key}
    for flag, path in files.items():
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"{flag} {path}: no such file")
    if auth_key and not root_certificates:
        raise ValueError("node authentication runs over TLS: pass --root-certificates with --auth-key")
    if mismatch := tls_mismatch(superlink, tls=root_certificates is not None):
        raise JoinError(mismatch)
    return client


def join(
    superlink: str,
    data_dir: str | Path,
    *,
    root_certificates: str | Path | None = None,
    auth_key: str | Path | None = None,
    state_dir: str | Path | None = None,
    node_key: str | None = None,
    num_classes: int = 10,
    max_wait_time: float = 60.0,
    executor: str = "warm",
    device: str | None = None,
) -> int:
    """Check everything local first (data, files, device), then run the SuperNode in the foreground."""
    data_dir = Path(data_dir).expanduser().resolve()
    client = check_locally(superlink, data_dir, num_classes, root_certificates, auth_key, device)
    key = node_key or re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()) or "edge"
    args = supernode_args(
        superlink,
        data_dir,
        root_certificates=Path(root_certificates) if root_certificates else None,
        auth_key=Path(auth_key) if auth_key else None,
        state_dir=Path(state_dir) if state_dir else None,
        node_key=key,
        max_wait_time=max_wait_time,
        executor=executor,
        device=device,
    )
    labelled = "labelled" if client.labelled else "unlabeled"
    print(
        f"florist join: node {key!r}, {len(client.x_train) + len(client.x_val)} train / {len(client.x_test)} test "
        f"samples ({labelled}, shape {client.input_shape}) -> SuperLink {superlink}",
        flush=True,
    )
    if not root_certificates:
        print("florist join: warning: no --root-certificates, traffic to the SuperLink is not encrypted", flush=True)
    log_path = NodeState(state_dir, key).path("supernode.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.unlink(missing_ok=True)
    process = spawn(args, log_path)
    output = follow(process, log_path)
    process.stop()  # also ends what the SuperNode left in its process group
    if process.popen.returncode not in (0, -2, -15):
        reason = diagnose(
            output,
            superlink=superlink,
            ca=root_certificates,
            wait=max_wait_time,
            pub=f"{auth_key}.pub" if auth_key else "<key>.pub",
        )
        raise JoinError(reason or f"the SuperNode exited with status {process.popen.returncode}; see its output above")
    return 0
