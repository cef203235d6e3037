"""What `florist join` leaves open to other users of its box and to whoever poses as its
SuperLink: its SuperNode's Runtime API (a real join, probed as another uid), dialing without TLS,
a certificate for other names, its state folder and log; and the standalone fork server's
socket and the staged app folder, which any local user could otherwise pick the code through."""

import os
import re
import signal
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from processes import labelled_folder, node_configs

from florist.common.flower_internals import runtime
from florist.deploy import bundle, forkserver
from florist.deploy.certs import make_ca_and_server
from florist.deploy.federation import LocalFederation
from florist.deploy.join import JoinError, join
from florist.deploy.spawning import free_port

NOBODY = 65534


def as_nobody(work: Callable[[], object]) -> tuple[int, int]:
    """Run `work` in a forked child as the unprivileged uid (this interpreter may sit where that
    uid cannot exec it); `outcome` reads what it returned or raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                text = repr(work())
            except BaseException as err:
                text = f"{type(err).__name__}: {err}"
            os.write(write, text.encode()[:4096])
        finally:
            os._exit(0)
    os.close(write)
    return pid, read


def outcome(child: tuple[int, int]) -> str:
    pid, read = child
    with os.fdopen(read, "rb") as pipe:
        text = pipe.read().decode()
    os.waitpid(pid, 0)
    return text


def secret_of(data_dir: Path) -> Path | None:
    """The SuperExec auth secret file on the command line of the SuperNode serving `data_dir`."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "--superexec-auth-secret-file" in args and any(str(data_dir) in a for a in args):
            return Path(args[args.index("--superexec-auth-secret-file") + 1])
    return None


def wait_for(pattern: str, log: Path, join_process: subprocess.Popen, timeout: float = 180.0) -> re.Match:
    deadline = time.monotonic() + timeout
    while not (found := re.search(pattern, log.read_text(errors="replace"))):
        assert join_process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    return found


def test_joins_runtime_api_answers_another_uid_with_401(tmp_path):
    assert os.getuid() == 0, "this test probes as another uid, which takes root (CI runs as root)"
    data, state, out = labelled_folder(tmp_path / "data"), tmp_path / "state", tmp_path / "join.out"
    fed = LocalFederation(tmp_path / "fed", node_configs(1, tmp_path), executor="flower")
    try:
        fed.start(num_started=0)  # a SuperLink only: join's node is the one under test
        cli = ["join", "--superlink", fed.fleet_address, "--insecure", "--data-dir", str(data)]
        cli += ["--state-dir", str(state), "--node-key", "box", "--max-wait-time", "30"]
        with open(out, "wb") as handle:
            joined = subprocess.Popen([sys.executable, "-m", "florist", *cli], stdout=handle, stderr=subprocess.STDOUT)
        try:
            served = wait_for(r"serving (127\.0\.0\.1:\d+)(, signing its task requests)?", out, joined)
            probe = outcome(as_nobody(lambda: runtime.acquire_task(runtime.runtime_client(served[1], None, None))))
            assert "401 Unauthorized" in probe, probe  # not a task (None when none is pending)
            assert served[2], "the warm executor signs its task requests"
            secret = secret_of(data)
            assert secret and stat.S_IMODE(secret.stat().st_mode) == 0o600 and secret.stat().st_size == 32
            assert stat.S_IMODE(secret.parent.stat().st_mode) == 0o700 and tmp_path not in secret.parents
            assert stat.S_IMODE((state / "box").stat().st_mode) == 0o700
            assert stat.S_IMODE((state / "box" / "supernode.log").stat().st_mode) == 0o600
        finally:
            joined.send_signal(signal.SIGTERM)
            try:
                joined.wait(60)
            except subprocess.TimeoutExpired:
                joined.kill()
                joined.wait()
    finally:
        fed.stop()
    assert not secret.parent.exists()  # removed at exit


def test_join_without_tls_must_be_told_insecure(tmp_path):
    with pytest.raises(ValueError, match="unencrypted and the SuperLink unauthenticated.*--insecure"):
        join(f"127.0.0.1:{free_port()}", labelled_folder(tmp_path / "data"), max_wait_time=2)


def serve_tls(certs: dict[str, Path], listener: socket.socket, stop: threading.Event) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs["server_cert"], certs["server_key"])
    context.set_alpn_protocols(["h2"])
    listener.settimeout(0.2)
    while not stop.is_set():
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            continue
        try:
            with context.wrap_socket(connection, server_side=True):
                pass
        except (ssl.SSLError, OSError):
            pass


def test_a_certificate_for_other_names_is_reported_as_a_hostname_mismatch(tmp_path):
    certs = make_ca_and_server(tmp_path / "certs", ["superlink.example"])  # and 127.0.0.1, not localhost
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    server = threading.Thread(target=serve_tls, args=(certs, listener, stop), daemon=True)
    server.start()
    try:
        with pytest.raises(JoinError, match=r"hostname mismatch.*superlink\.example, 127\.0\.0\.1, not localhost"):
            join(
                f"localhost:{listener.getsockname()[1]}",
                labelled_folder(tmp_path / "data"),
                root_certificates=certs["ca"],
                max_wait_time=5,
            )
    finally:
        stop.set()
        server.join(5)
        listener.close()


def test_a_link_planted_as_the_node_folder_is_refused_and_shared_folders_warned_of(tmp_path, capsys):
    data, state, elsewhere = labelled_folder(tmp_path / "data"), tmp_path / "state", tmp_path / "elsewhere"
    state.mkdir()
    elsewhere.mkdir()
    os.chmod(data, 0o777)
    os.chmod(state, 0o777)
    (state / "box").symlink_to(elsewhere)  # as another user could, in a folder writable by all
    with pytest.raises(JoinError, match=r"node state folder .*box: expected a folder, not a link"):
        join(f"127.0.0.1:{free_port()}", data, insecure=True, state_dir=state, node_key="box", max_wait_time=2)
    assert not list(elsewhere.iterdir())
    out = capsys.readouterr().out
    assert f"data folder {data} is writable by every user" in out
    assert f"state folder {state} is writable by every user" in out


def test_the_fork_servers_socket_is_its_owners_only(tmp_path):
    assert os.getuid() == 0, "this test connects as another uid, which takes root (CI runs as root)"
    folder = Path(tempfile.mkdtemp())
    os.chmod(folder, 0o711)  # others may reach the socket's name, as in a shared folder
    path = str(folder / "fork.sock")
    listener = forkserver.listen(path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        refused = outcome(as_nobody(lambda: socket.socket(socket.AF_UNIX).connect(path)))
        assert refused.startswith("PermissionError"), refused
        os.chmod(path, 0o666)  # were the mode lost: the peer's uid is still checked
        other = as_nobody(lambda: connected(path).recv(9))
        listener.settimeout(60)
        assert forkserver.accept(listener) is None  # refused and closed
        assert outcome(other) == "b''"
        mine = connected(path)
        accepted = forkserver.accept(listener)
        assert accepted is not None
        accepted.close()
        mine.close()
    finally:
        listener.close()
        os.unlink(path)
        os.rmdir(folder)


def connected(path: str) -> socket.socket:
    connection = socket.socket(socket.AF_UNIX)
    connection.settimeout(60)  # bounded, should the other end never answer
    connection.connect(path)
    return connection


def test_a_tampered_staged_app_folder_is_staged_afresh(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    stage = bundle.app_dir()
    assert stage != bundle.checkout(), "off the fast path the checkout itself is used: nothing staged"
    init = stage / "florist" / "__init__.py"
    original = init.read_bytes()
    init.write_bytes(original + b"\nimport os  # another user's code\n")
    (stage / "florist" / "planted.py").write_text("import os\n")
    assert bundle.app_dir() == stage
    assert init.read_bytes() == original and not (stage / "florist" / "planted.py").exists()
