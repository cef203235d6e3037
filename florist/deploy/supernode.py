"""`florist supernode`: Flower's SuperNode with florist's deployment fast path.

It takes `flower-supernode`'s options, plus `--executor`:

- `warm` (the default): the SuperNode runs with `--isolation process` beside florist's warm
  executor (`deploy/executor.py`), which this process starts and stops with itself;
- `flower`: Flower's own SuperExec, a fresh `flwr-clientapp` process per message (the stock
  path, for comparison and for apps that are not florist).

and `--trust-app SHA256` (repeatable): the app bundles this box runs. Any other is refused
before it is fetched, whichever executor would have run it, with an error reply to the server
(`guard_apps`); without the flag, any app runs, as with Flower's own SuperNode.

Either way the SuperNode's polling is paced (`flower_internals.pace_supernode`): quick while
messages flow, slower while the federation idles, instead of 3 s after every empty pull.

On a Flower other than the one florist's fast path was written for (`flower_internals.fast_path`)
it says so in one line and runs Flower's stock SuperNode: `--executor warm` becomes `flower`, and
the polling is Flower's own.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Sequence

from florist.common import flower_internals
from florist.common.flower_internals import apptrust, runtime
from florist.common.pacing import Backoff
from florist.deploy import forkserver
from florist.deploy.bundle import TrustedApps
from florist.deploy.executor import DEFAULT_APP, STOP_GRACE, THREAD_ENV
from florist.deploy.spawning import colours_for_terminals_only

log = logging.getLogger("flwr").getChild(__name__)

EXECUTORS = ("warm", "flower")


def _runtime_options(flower_args: list[str]) -> argparse.Namespace:
    """The `flower-supernode` options the executor needs to know about."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--isolation")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", default="9094")
    parser.add_argument("--ssl-ca-certfile")
    parser.add_argument("--superexec-auth-secret-file")
    return parser.parse_known_args(flower_args)[0]


class SupervisedExecutor:
    """The warm executor of this SuperNode, restarted if it ever dies while the SuperNode runs
    (a node whose executor is gone would take messages and never answer them).

    Two pipes spare both sides their polling: the SuperNode writes to one whenever it pulls a
    message (the executor waits on it for the task), and the executor's children write to the
    other when their reply has been handed over (`replied` ends the SuperNode's wait for it).
    """

    def __init__(self, command: list[str], fork_server: str | None = None):
        """`command` starts the executor; with `fork_server` (a socket), the fork server there
        forks it with the same options instead, if it can (`forkserver.py`)."""
        self.task_read, self.task_write = os.pipe()
        self.done_read, self.done_write = os.pipe()
        os.set_blocking(self.task_write, False)
        self.fork_server, self.options = fork_server, command[3:]  # after `python -m florist.deploy.executor`
        self.command = command + ["--wake-fd", str(self.task_read), "--done-fd", str(self.done_write)]
        self.stopping, self.replied = threading.Event(), threading.Event()
        self.process = self._start()
        threading.Thread(target=self._watch, name="florist-executor-watch", daemon=True).start()
        threading.Thread(target=self._relay_replies, name="florist-executor-replies", daemon=True).start()

    def _start(self, fork: bool = True) -> subprocess.Popen | forkserver.Forked:
        """The executor, forked by the fork server if there is one (asked without waiting for
        its answer, so that the SuperNode connects while the fork server preloads)."""
        if self.fork_server and fork:
            try:
                return forkserver.request(
                    self.fork_server, self.options, sys.stderr.fileno(), (self.task_read, self.done_write)
                )
            except OSError as err:
                log.warning(
                    "no executor from the fork server at %s (%s): starting one of its own", self.fork_server, err
                )
        return subprocess.Popen(self.command, env=os.environ | THREAD_ENV, pass_fds=(self.task_read, self.done_write))

    def _watch(self) -> None:
        while not self.stopping.wait(1.0):
            if self.process.poll() is not None and not self.stopping.is_set():
                if refused := isinstance(self.process, forkserver.Forked) and self.process.refused:
                    log.warning("the fork server at %s forked no executor: starting one of its own", self.fork_server)
                else:
                    log.warning("the warm executor exited (status %s); starting it again", self.process.returncode)
                self.process = self._start(fork=not refused)

    def _relay_replies(self) -> None:
        while os.read(self.done_read, 4096):
            self.replied.set()

    def message_arrived(self) -> None:
        try:
            os.write(self.task_write, b"!")
        except BlockingIOError:  # the executor has a wake-up pending already
            pass

    def stop(self) -> None:
        self.stopping.set()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_GRACE + 5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def executor_command(flower_args: list[str], preload: str, app_dir: str | None = None) -> tuple[list[str], list[str]]:
    """The warm executor's command for this SuperNode, and the SuperNode's arguments (with
    `--isolation process`, so that the SuperNode leaves its tasks to the executor). A
    `--superexec-auth-secret-file` goes to both: the SuperNode's Runtime API then serves tasks
    only to requests signed with it, as Flower's SuperExec signs them."""
    options = _runtime_options(flower_args)
    if options.isolation not in (None, "process"):
        raise ValueError(
            f"--executor warm runs the SuperNode with --isolation process, not {options.isolation!r}; "
            "use --executor flower for Flower's own executor"
        )
    host = "127.0.0.1" if options.host in ("0.0.0.0", "::", "[::]", "") else options.host
    command = [
        sys.executable,
        "-m",
        "florist.deploy.executor",
        "--runtime-api-address",
        f"{host}:{options.port}",
        "--parent-pid",
        str(os.getpid()),
        "--app",
        preload,
    ]
    if options.ssl_ca_certfile:
        command += ["--root-certificates", options.ssl_ca_certfile]
    if app_dir:
        command += ["--app-dir", app_dir]
    if secret := options.superexec_auth_secret_file:  # the SuperNode requires it of its executor: it signs with it
        runtime.load_auth_secret(secret)  # unreadable or empty: ValueError, now
        command += [
            "--superexec-auth-secret-file",
            os.path.abspath(os.path.expanduser(secret)),
        ]  # a forked one's cwd differs
    return command, flower_args + ([] if options.isolation else ["--isolation", "process"])


def run(
    executor: str,
    flower_args: list[str],
    preload: str = DEFAULT_APP,
    fork_server: str | None = None,
    app_dir: str | None = None,
    trust_apps: Sequence[str] = (),
) -> None:
    """Run the SuperNode in this process until it exits (Ctrl-C or SIGTERM stop it, and the
    executor with it). `preload` is the ClientApp the warm executor serves warm; `fork_server`
    the socket of a fork server that has it preloaded (`forkserver.py`); `app_dir` the app's
    publishable files, where the app is installed as a package (`executor.py --app-dir`);
    `trust_apps` the sha256 of every app bundle this box runs (none given: any)."""
    colours_for_terminals_only()
    if executor not in EXECUTORS:
        raise ValueError(f"--executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    guard_apps(trust_apps)
    if executor == "warm" and not flower_internals.fast_path():  # which has said why, once
        executor, flower_args = "flower", _without_process_isolation(flower_args)
    backoff = Backoff(floor=0.05, cap=1.0, ratio=0.1)
    if executor == "warm":
        command, flower_args = executor_command(flower_args, preload, app_dir)
        supervised = SupervisedExecutor(command, fork_server)
        atexit.register(supervised.stop)
        flower_internals.pace_supernode(backoff, wake=supervised.replied, on_message=supervised.message_arrived)
    else:  # Flower's SuperExec polls for tasks every second unless told otherwise
        os.environ.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.1")
        flower_internals.pace_supernode(backoff)
    flower_internals.supernode_main(flower_args)


def guard_apps(trust_apps: Sequence[str]) -> None:
    """From here on, this process's SuperNode runs only the bundles `trust_apps` names, refusing
    any other before it is fetched (`apptrust.py`); with none named, it says in one line that
    it runs whatever the SuperLink sends. A Flower where the check cannot be made is refused."""
    if not trust_apps:
        log.warning(
            "no --trust-app given: this box runs any app the SuperLink sends it "
            "(`florist app-hash` prints the sha256 to trust)"
        )
        return
    trusted = TrustedApps.parse(trust_apps)
    try:
        apptrust.refuse_untrusted_apps(trusted)
    except RuntimeError as err:
        raise RuntimeError(
            f"--trust-app cannot be enforced on Flower {flower_internals.installed()} ({err}); not started"
        ) from None
    log.info("this box runs only the app bundles %s", ", ".join(sorted(trusted.hashes)))


def _without_process_isolation(flower_args: list[str]) -> list[str]:
    """`flower_args` less `--isolation process`, which `--executor warm` allows (its executor
    serves the tasks) but would leave Flower's own SuperNode with no one to run them."""
    if _runtime_options(flower_args).isolation != "process":
        return flower_args
    kept, skip = [], False
    for i, arg in enumerate(flower_args):
        if skip:
            skip = False
        elif arg == "--isolation" and i + 1 < len(flower_args):
            skip = True
        elif arg != "--isolation=process":
            kept.append(arg)
    return kept
