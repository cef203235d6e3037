"""`florist join`: start a SuperNode on an edge box, pointed at its own data folder and at a
running SuperLink, and turn Flower's failure modes into messages that say what to fix."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import socket
import ssl
import stat
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from florist.client.personal import footprint
from florist.client.state import NodeState
from florist.common import devices
from florist.common.data import ClientData
from florist.common.folders import ImageOptions, folder_client
from florist.deploy.bundle import TrustedApps
from florist.deploy.serving import write_auth_secret
from florist.deploy.spawning import Process, free_port, spawn, supernode_command, toml_node_config

# (patterns in the SuperNode's output, what it means for the user), most specific first
DIAGNOSES = [
    (
        ("CERTIFICATE_VERIFY_FAILED", "certificate signature failure", "SSL/TLS handshake error"),
        "the SuperLink's TLS certificate does not verify against {ca}: wrong CA file, or the certificate was "
        "not issued for the address {superlink} (check the --hosts given to `florist certs`)",
    ),
    (
        ("[code: 2004]",),  # the SuperLink says which in its own log only
        "the SuperLink refused to activate this node: its public key is not registered there (on the SuperLink's "
        "machine run: flwr supernode register {pub} <connection>), or a node with this key is still online there "
        "(another box with the same key, or this one stopped less than a minute ago: retry in a minute)",
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


def _tls_probe(host: str, port: int, cafile: str | None = None) -> bytes | None:
    """The certificate the server at host:port presents (DER), None if it does not speak TLS
    (OSError if it does not answer); with `cafile`, verified against it and `host`
    (ssl.SSLCertVerificationError if it does not verify)."""
    sock = socket.create_connection((host, port), timeout=3)
    context = ssl.create_default_context(cafile=cafile)
    if cafile is None:
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # only asking whether it speaks TLS
    context.set_alpn_protocols(["h2"])
    try:
        with context.wrap_socket(sock, server_hostname=host) as tls:
            return tls.getpeercert(binary_form=True)
    except ssl.SSLCertVerificationError:
        raise
    except (ssl.SSLError, OSError):
        return None
    finally:
        sock.close()


def certificate_names(der: bytes) -> list[str]:
    """The host names and addresses a certificate is issued for (its SANs, else its CN)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_der_x509_certificate(der)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return [str(name) for kind in (x509.DNSName, x509.IPAddress) for name in san.get_values_for_type(kind)]


def tls_mismatch(superlink: str, root_certificates: str | Path | None) -> str | None:
    """What is wrong when the SuperLink answers at `superlink` but speaks TLS where this node
    was given no CA, or plain text where it was, or presents a certificate issued for other
    names; None when it matches or does not answer (the SuperNode's own retries then tell
    "unreachable", and its output a certificate that does not verify)."""
    host, _, port = superlink.rpartition(":")
    try:
        der = _tls_probe(host, int(port))
    except OSError:
        return None
    if der and not root_certificates:
        return (
            f"the SuperLink at {superlink} speaks TLS: pass --root-certificates with the CA certificate it was "
            "issued by (ca.crt)"
        )
    if root_certificates and not der:
        return (
            f"the SuperLink at {superlink} does not speak TLS (it runs with --insecure): leave out "
            "--root-certificates, or restart it with TLS"
        )
    if der and root_certificates:
        try:
            _tls_probe(host, int(port), str(root_certificates))
        except ssl.SSLCertVerificationError as err:  # another CA: the SuperNode's output tells it
            if err.verify_code in (62, 64):  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
                return (
                    f"hostname mismatch: the SuperLink's certificate at {superlink} is issued for "
                    f"{', '.join(certificate_names(der)) or 'no names'}, not {host}: dial one of those names, "
                    f"or reissue it with `florist certs --hosts ... {host}`"
                )
        except OSError:  # gone meanwhile: the SuperNode's retries tell it
            pass
    return None


# Node-config keys a box sets with flags of their own, and the one it never sets.
SET_BY_FLAGS = {"data-dir": "--data-dir", "node-key": "--node-key", "state-dir": "--state-dir", "device": "--device"}
SET_BY_FLAGS |= {"unseen": "--unseen"}
NEVER = {"trusted-server": "a box never trusts another party's server: its caps and folders bind that server"}


def node_config_keys() -> set[str]:
    """What `--node-config` may set on a box: its caps, threads and public folder, and the run's
    settings a node may override (the common ones and every strategy's)."""
    from florist.client.guard import Limits
    from florist.config import SECTIONS, RunConfig

    caps = {"node-" + f.name.replace("_", "-") for f in dataclasses.fields(Limits)}
    return (
        caps
        | {"torch-threads", "public-dir"}
        | set(RunConfig.node_keys()).union(*(s.node_keys() for s in SECTIONS.values()))
    )


def check_node_config(values: Mapping[str, Any]) -> None:
    """Refuse, in one line naming the key, what a box's `--node-config` may not say."""
    from florist.client.guard import Limits

    for key in values:
        if key in SET_BY_FLAGS:
            raise ValueError(f"--node-config {key}: set it with {SET_BY_FLAGS[key]}")
        if key in NEVER:
            raise ValueError(f"--node-config {key}: {NEVER[key]}")
        if key not in (allowed := node_config_keys()):
            raise ValueError(f"--node-config {key}: not a key a box sets; it may set {', '.join(sorted(allowed))}")
    Limits.of(values)  # a cap that is no positive number, named


def supernode_args(
    superlink: str,
    data_dir: Path,
    *,
    root_certificates: Path | None,
    auth_key: Path | None,
    state_dir: Path | None,
    node_key: str,
    max_wait_time: float | None,
    executor: str = "warm",
    device: str | None = None,
    trust_apps: Sequence[str] = (),
    auth_secret: Path | None = None,
    unseen: bool = False,
    node_config: Mapping[str, Any] | None = None,
) -> list[str]:
    """`florist supernode`'s command line for this box; `max_wait_time` None: it retries forever."""
    own = {"data-dir": str(data_dir), "node-key": node_key} | ({"state-dir": str(state_dir)} if state_dir else {})
    own |= ({"device": device} if device else {}) | ({"unseen": True} if unseen else {})
    args = [
        *supernode_command(executor),
        "--superlink",
        superlink,
        "--node-config",
        toml_node_config(dict(node_config or {}) | own),
        "--port",
        str(free_port()),
        *(["--max-wait-time", str(max_wait_time)] if max_wait_time is not None else []),
    ]
    args += ["--root-certificates", str(root_certificates)] if root_certificates else ["--insecure"]
    if auth_key:
        args += ["--auth-supernode-private-key", str(auth_key)]
    if auth_secret:  # the Runtime API then serves tasks only to the executor, which signs with it
        args += ["--superexec-auth-secret-file", str(auth_secret)]
    return args + [f"--trust-app={sha256}" for sha256 in trust_apps]


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
    insecure: bool = False,
    images: ImageOptions | None = None,
) -> ClientData:
    """What a box can get wrong before it dials, each in one line: the address, the device, the
    data folder (naming the file), the certificate and key files, no TLS without --insecure,
    TLS on one side only, a certificate issued for other names."""
    if not re.fullmatch(r"[^\s:]+:\d+", superlink):
        raise ValueError(f"--superlink must be HOST:PORT (the SuperLink's Fleet API), got {superlink!r}")
    if device:
        devices.resolve(device, "--device")  # a device this machine lacks fails here, not at the first message
    client = folder_client(data_dir, num_classes, seed=0, val_fraction=0.15, images=images or ImageOptions())
    files = {"--root-certificates": root_certificates, "--auth-key": auth_key}
    for flag, path in files.items():
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"{flag} {path}: no such file")
    if auth_key and not root_certificates:
        raise ValueError("node authentication runs over TLS: pass --root-certificates with --auth-key")
    if root_certificates and insecure:
        raise ValueError("--insecure dials without TLS: leave it out with --root-certificates")
    if not root_certificates and not insecure:
        raise ValueError(
            f"no --root-certificates: traffic to {superlink} would be unencrypted and the SuperLink "
            "unauthenticated (anyone on the path could pose as it); pass --root-certificates CA, "
            "or --insecure to dial it so anyway"
        )
    if mismatch := tls_mismatch(superlink, root_certificates):
        raise JoinError(mismatch)
    return client


@contextlib.contextmanager
def runtime_secret(executor: str) -> Iterator[Path | None]:
    """With the warm executor, a SuperExec auth secret for this node's Runtime API, in a private
    (0700) temporary folder removed at exit: other local users then get 401 from the port the
    SuperNode serves its tasks on. (Flower's own executor runs without the Runtime API port.)"""
    if executor != "warm":
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="florist-join-"))
    try:
        yield write_auth_secret(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def private_folder(path: Path) -> Path:
    """`path` as a folder only this user can enter: its missing components made 0700, and the
    last one refused if it is a link or another user's (it holds the node's models and log)."""
    path = Path(path).expanduser().absolute()
    for part in reversed([p for p in (path, *path.parents) if not os.path.lexists(p)]):
        with contextlib.suppress(FileExistsError):
            os.mkdir(part, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as err:
        raise JoinError(f"node state folder {path}: expected a folder, not a link or file ({err.strerror})") from None
    try:
        if os.fstat(fd).st_uid != os.getuid():
            raise JoinError(f"node state folder {path}: expected a folder of this user's, it is another user's")
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def warn_if_shared(folder: Path, what: str) -> None:
    """One line when every local user can write `folder` (and so swap the files it holds)."""
    if folder.is_dir() and folder.stat().st_mode & stat.S_IWOTH:
        print(
            f"florist join: warning: {what} {folder} is writable by every user of this machine, "
            "who can then replace what this node reads and writes there",
            flush=True,
        )


def fresh_log(folder: Path) -> Path:
    """An empty supernode.log in `folder` that only this user can read (0600, no link followed)."""
    path = folder / "supernode.log"
    path.unlink(missing_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    return path


def announce(key: str, client: ClientData, superlink: str, tls: bool, state_folder: Path) -> None:
    """What this node brings and where it dials, so a wrong folder or address shows at once, and
    what its state folder takes on the disk (its models are its last `keep-models` runs')."""
    labelled = "labelled" if client.labelled else "unlabeled"
    print(
        f"florist join: node {key!r}, {len(client.x_train) + len(client.x_val)} train / {len(client.x_test)} test "
        f"samples ({labelled}, shape {client.input_shape}) -> SuperLink {superlink}",
        flush=True,
    )
    print(f"florist join: state folder {state_folder}: {footprint(state_folder)}", flush=True)
    if not tls:
        print(
            "florist join: warning: --insecure: traffic to the SuperLink is not encrypted and the SuperLink "
            "is not authenticated",
            flush=True,
        )


def join(
    superlink: str,
    data_dir: str | Path,
    *,
    root_certificates: str | Path | None = None,
    insecure: bool = False,
    auth_key: str | Path | None = None,
    state_dir: str | Path | None = None,
    node_key: str | None = None,
    num_classes: int = 10,
    max_wait_time: float | None = 60.0,
    executor: str = "warm",
    device: str | None = None,
    trust_apps: Sequence[str] = (),
    unseen: bool = False,
    node_config: Mapping[str, Any] | None = None,
) -> int:
    """Check everything local first (data, files, device, the apps to trust, the node config),
    then run the SuperNode in the foreground. `unseen`: this box never trains (it is scored on
    the model the run gives it); `node_config`: more of its keys (caps, threads, folders)."""
    data_dir = Path(data_dir).expanduser().resolve()
    TrustedApps.parse(trust_apps)  # a mistyped hash fails here, in one line, before anything starts
    check_node_config(node_config or {})
    images = ImageOptions.of_node(node_config or {})  # decoded as the node will, with its own settings
    client = check_locally(superlink, data_dir, num_classes, root_certificates, auth_key, device, insecure, images)
    key = node_key or re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()) or "edge"
    state = NodeState(state_dir, key)
    announce(key, client, superlink, bool(root_certificates), state.folder)
    warn_if_shared(data_dir, "data folder")
    warn_if_shared(state.folder.parent, "state folder")
    log_path = fresh_log(private_folder(state.folder))
    with runtime_secret(executor) as secret:
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
            trust_apps=trust_apps,
            auth_secret=secret,
            unseen=unseen,
            node_config=node_config,
        )
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
