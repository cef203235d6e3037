"""How a local federation's SuperLink runs its ServerApps: warm, each run a child forked by the
executor the fork server preloaded (`forkserver.py`, `executor.py`), or, should that fail or
Flower differ from the pinned one, Flower's own SuperExec with a fresh process per run."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from florist.common.storage import open_log
from florist.deploy import forkserver, netns
from florist.deploy.spawning import Process, flower_bin, spawn

log = logging.getLogger(__name__)


def write_auth_secret(folder: Path) -> Path:
    """A new SuperExec auth secret (32 random bytes) in `folder`, in a file only its owner can
    read (`florist join` uses it too)."""
    import secrets

    path = folder / "superexec-auth-secret"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(secrets.token_bytes(32))
    return path


class ServerAppRunners:
    """The part of `LocalFederation` (which inherits it) that serves its SuperLink's runs."""

    def _serve_runs(self, timeout: float) -> None:
        """Ask the fork server for the warm executor of this SuperLink's ServerApps: a run then
        starts in a forked child instead of a new `flwr-serverapp` process (5-8 CPU-s), and it
        ends when the SuperLink does (`--parent-pid`), as Flower's would. The answer comes once
        the fork server has preloaded; meanwhile the SuperNodes start."""
        from florist.deploy.executor import DEFAULT_APP

        deadline = time.monotonic() + timeout
        while not self.fork_socket.exists():  # named once the fork server listens (before it preloads)
            if not self.fork_server.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server did not start:\n{self.fork_server.tail()}")
            time.sleep(0.1)
        argv = [
            "--runtime-api-address",
            self.control_address,
            "--parent-pid",
            str(self.superlink.pid),
            "--app",
            self.preload or DEFAULT_APP,
            *self._runtime_tls(),
            *self._signed(),
        ]
        try:
            with open_log(self.logs / "server-executor.log", append=True) as log_file:
                self.server_executor = forkserver.request(str(self.fork_socket), argv, log_file.fileno())
        except OSError as err:
            self._serve_runs_stock(f"the fork server is unreachable ({err})")

    def ensure_runs_served(self) -> None:
        """If the fork server refused the ServerApp executor, or it died, runs would wait forever
        on a SuperLink with `--isolation process`: start Flower's own SuperExec for it instead."""
        if self.server_executor is not None and self.server_executor.poll() is not None:
            why = "refused it" if self.server_executor.refused else "it exited"
            self.server_executor = None
            self._serve_runs_stock(f"no warm ServerApp executor ({why})")

    def _serve_runs_stock(self, why: str) -> None:
        log.warning("%s: the SuperLink's runs go to Flower's own SuperExec", why)
        args = [
            flower_bin("flower-superexec"),
            *(self._runtime_tls() or ["--insecure"]),
            "--runtime-api-address",
            self.control_address,
            "--parent-pid",
            str(self.superlink.pid),
            *self._signed(),
        ]
        self.superexec = self._spawn("superexec", netns.SUPERLINK, args)

    def _runtime_tls(self) -> list[str]:
        return ["--root-certificates", str(self.certs / "ca.crt")] if self.tls else []

    def _signed(self) -> list[str]:
        """The option that gives a SuperNode, the SuperLink or an executor the federation's
        SuperExec auth secret (with `--isolation process` Flower then requires every task request
        to its Runtime API to be signed with it; an executor signs with it)."""
        return ["--superexec-auth-secret-file", str(self.auth_secret)] if self.auth_secret else []

    def _private_folder(self) -> Path:
        """This federation's folder for what no one else may read (0700, made on first use,
        removed on stop): outside the workdir, which may be the results folder."""
        import tempfile

        if self.private is None:
            self.private = Path(tempfile.mkdtemp(prefix="florist-"))  # 0700; short: a Unix socket's path is short
        return self.private

    def _make_auth_secret(self) -> Path:
        return write_auth_secret(self._private_folder())

    def _stop_server_executor(self, grace: float = 10.0) -> None:
        if self.server_executor is not None:
            self.server_executor.terminate()
            try:
                self.server_executor.wait(grace)
            except subprocess.TimeoutExpired:
                self.server_executor.kill()
            self.server_executor = None

    def start_fork_server(self) -> Process:
        """The process that preloads the ClientApp once and forks every SuperNode's warm
        executor (`forkserver.py`). Its socket lives in a private folder with a short path
        (a Unix socket's path is limited to about 100 bytes)."""
        from florist.deploy.executor import DEFAULT_APP, THREAD_ENV

        self.fork_socket = self._private_folder() / "fork-server"
        args = [
            sys.executable,
            "-m",
            "florist.deploy.forkserver",
            "--socket",
            str(self.fork_socket),
            "--app",
            self.preload or DEFAULT_APP,
            "--parent-pid",
            str(os.getpid()),
        ]
        self.fork_server = spawn(args, self.logs / "fork-server.log", env=self.env | THREAD_ENV, cwd=self.workdir)
        return self.fork_server
