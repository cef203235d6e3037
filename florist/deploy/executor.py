"""The warm executor: a SuperNode's ClientApps (or a SuperLink's ServerApps) without a new
Python interpreter per message (or per run).

Flower's SuperExec starts a fresh `flwr-clientapp` process for every message, which imports
torch, flwr and florist again (3-4 s on a 2-core machine) before the handler's own work
(0.1-1 s), and a fresh `flwr-serverapp` process for every run. This executor imports them once,
then forks one child per task. Each task still runs in its own process through Flower's own
ClientApp or ServerApp runtime (task token, heartbeats, message pull, reply push), so whatever a
handler does to its process (raise, leak, hang until its deadline, get killed) ends with that
child; the executor goes on with the next task.

It runs only what it preloaded. One app bundle (FAB) is served warm: the one `flwr run` builds
from the checkout the preloaded app was imported from, recognised by its full sha256 (checked at
start-up to hold exactly the preloaded package's files and components, `preloaded.py`). A task of
any other bundle, even one that differs by a single added file, runs in Flower's stock per-task
process. The folder Flower installs that bundle in is checked to hold exactly its files (Flower
names it by 8 hex digits of the hash), and a warm child never puts it on `sys.path`, so nothing
in it can shadow a module the preloaded code imports later. On a box that names the apps it
trusts (`florist supernode --trust-app`), a task of any other bundle never reaches this executor:
its SuperNode refuses the bundle before fetching it (`flower_internals/apptrust.py`).

With `--superexec-auth-secret-file` (the SuperNode's or SuperLink's own), its task requests are
signed as Flower's SuperExec signs them: the Runtime API then serves tasks to no one else.

Fork safety: a forked child has only the thread that forked, so a lock that another thread
held at that moment stays locked in the child forever. This process therefore starts no
thread: it talks to its SuperNode (SuperLink) over HTTP with httpx's synchronous client (no
gRPC channel, which would start threads), never runs Ray, and never computes with torch or
faiss (their thread pools start at the first parallel operation, not on import). OpenBLAS
(numpy) and jemalloc (pyarrow, imported by scikit-learn) do start threads on import unless
told not to, which `THREAD_ENV` does before anything is imported. Before every fork the
executor counts its OS threads and, should there ever be more than one, uses Flower's stock
process instead.

Run it beside a SuperNode (or SuperLink) started with `--isolation process` (`florist supernode`
does both for a SuperNode, `LocalFederation` for its SuperLink):

    python -m florist.deploy.executor --runtime-api-address 127.0.0.1:9094 [--parent-pid PID]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from florist.client.deadline import DISPOSABLE
from florist.common import flower_internals
from florist.common.flower_internals import runtime
from florist.common.pacing import TaskPolls
from florist.common.processes import send
from florist.deploy.preloaded import PreloadedApp
from florist.deploy.spawning import colours_for_terminals_only

log = logging.getLogger("florist.executor")

# Set before numpy and pyarrow are imported, so that importing them starts no thread.
THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false"}
STOP_GRACE = 5.0  # seconds children get to finish after SIGTERM before SIGKILL
DEFAULT_APP = "florist.apps.client:app"


def os_threads() -> int:
    """Threads of this process, native ones included (Linux); Python's count elsewhere."""
    try:
        return len(os.listdir("/proc/self/task"))
    except FileNotFoundError:
        return threading.active_count()


@dataclasses.dataclass
class Child:
    task_id: int
    kind: str  # "warm" or "stock"
    popen: subprocess.Popen | None = None  # stock children; warm ones are reaped by pid
    started: float = dataclasses.field(default_factory=time.monotonic)


class WarmExecutor:
    """Acquires the SuperNode's tasks and runs each in a forked child or a stock process."""

    def __init__(
        self,
        address: str,
        app: PreloadedApp,
        root_certificates: str | None = None,
        parent_pid: int | None = None,
        wake_fd: int | None = None,
        done_fd: int | None = None,
        lifeline: socket.socket | None = None,
        auth_secret: bytes | None = None,
    ):
        """`wake_fd`: readable when the SuperNode has pulled a message (else the executor only
        polls); `done_fd`: where each child tells the SuperNode that its reply is there;
        `lifeline`: a connection the SuperNode holds while it wants this executor (a forked
        executor's, `forkserver.py`), else `parent_pid` is the SuperNode's PID; `auth_secret`:
        the SuperExec auth secret the Runtime API requires, if any."""
        self.address, self.app, self.root_certificates, self.parent_pid = address, app, root_certificates, parent_pid
        self.wake_fd, self.done_fd, self.lifeline = wake_fd, done_fd, lifeline
        self.client = runtime.runtime_client(address, root_certificates, auth_secret)
        self.children: dict[int, Child] = {}
        self.verdicts: dict[str, str | None] = {}  # FAB hash -> why it is not the preloaded app's bundle
        self.installed: set[str] = set()  # FAB hashes whose installed folder holds exactly the bundle
        # Polling is the safety net when a wake-up is missed (or there is no wake pipe).
        self.polls = TaskPolls(woken=wake_fd is not None)
        self.stopping = False
        self.served = {"warm": 0, "stock": 0}

    def stop(self, *_: object) -> None:
        self.stopping = True

    def serve(self) -> None:
        """Until stopped, or until the process that started us is gone."""
        unreachable = False
        try:
            while not self.stopping and self.wanted():
                self.reap()
                try:
                    acquired = flower_internals.acquire_task(self.client)
                    unreachable = False
                except Exception as err:  # the SuperNode restarting or gone: keep trying, say so once
                    if not unreachable:
                        log.warning("Runtime API at %s unreachable (%s); retrying", self.address, err)
                    unreachable, acquired = True, None
                if acquired:
                    self.launch(*acquired)
                    self.polls.taken()
                self.wait()
        finally:
            self.close()

    def wanted(self) -> bool:
        """Whether the SuperNode still wants this executor: it holds the lifeline, or lives."""
        if self.lifeline is not None:
            return not closed(self.lifeline)
        return self.parent_pid is None or os.getppid() == self.parent_pid

    def wait(self) -> None:
        """Until the next poll is due, the SuperNode says it has pulled a message (then poll
        quickly until its task is there), or it lets go of the lifeline."""
        watched = [fd for fd in (self.wake_fd, self.lifeline) if fd is not None]
        if not watched:
            self.polls.backoff.sleep()
        elif self.wake_fd in select.select(watched, [], [], self.polls.delay())[0]:
            self.polls.woken(len(os.read(self.wake_fd, 4096)))

    def why_not_warm(self, task) -> str | None:
        """None if `task` may run in a forked child, else the reason it may not."""
        if flower_internals.app_component(task) is None:
            return f"a {task.type} task"
        if task.fab_hash not in self.verdicts:
            verdict = self.verdicts[task.fab_hash] = self.judge(task.fab_hash)
            log.info("app bundle %s: %s", task.fab_hash, verdict or "the preloaded app's, served warm")
        if self.verdicts[task.fab_hash]:
            return "not the preloaded app's bundle"
        folder = flower_internals.installed_fab(task.fab_hash)
        if folder is None and not flower_internals.fast_path():  # no child would check what it installs
            return "its app bundle is not installed here yet"
        if folder is not None and task.fab_hash not in self.installed:
            if why := self.app.holds(folder):
                log.warning("app bundle %s: %s does not hold exactly it: %s", task.fab_hash, folder, why)
                return f"{folder} does not hold exactly its app bundle"
            self.installed.add(task.fab_hash)
        if (threads := os_threads()) > 1:
            return f"this process runs {threads} threads, so forking it is not safe"
        return None

    def judge(self, fab_hash: str) -> str | None:
        """Why the bundle `fab_hash` is not the preloaded app's (compared by full hash); None if it is."""
        if not self.app.bundle_hash:
            return "not served warm: this executor knows no bundle of the preloaded app (not run from a checkout)"
        if flower_internals.unusable("fab"):
            return "not served warm: this Flower installs app bundles where florist does not look"
        if fab_hash != self.app.bundle_hash:
            return f"not the preloaded app's bundle ({self.app.bundle_hash}): Flower's stock process runs it"
        return None

    def holds(self, fab_hash: str, folder: Path) -> bool:
        """Whether `folder` holds exactly the bundle `fab_hash`, which must be the preloaded app's
        (in a forked child: what it installs is checked before it is used)."""
        if fab_hash != self.app.bundle_hash:
            return False
        return fab_hash in self.installed or self.app.holds(folder) is None

    def launch(self, token: str, task) -> None:
        reason = self.why_not_warm(task)
        if reason is None:
            pid, child = self.fork(token, task), Child(task.task_id, "warm")
        else:
            command = flower_internals.stock_command(
                task, self.address, token, self.root_certificates, self.watched(task, os.getpid())
            )
            popen = subprocess.Popen(command, env=os.environ | {DISPOSABLE: "1"})
            pid, child = popen.pid, Child(task.task_id, "stock", popen)
        self.children[pid] = child
        self.served[child.kind] += 1
        log.info(
            "task %d of run %d: %s process %d%s",
            task.task_id,
            task.run_id,
            child.kind,
            pid,
            f" ({reason})" if reason else "",
        )

    def fork(self, token: str, task) -> int:
        """A child that runs the task through Flower's ClientApp or ServerApp runtime and exits."""
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:  # the child: never returns into the executor's loop
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)  # Flower's runtime installs its own
            if self.lifeline is not None:  # a child holding it would keep its executor "alive"
                self.lifeline.close()
            if flower_internals.app_component(task) == "serverapp":
                flower_internals.run_serverapp(
                    self.address, token, self.root_certificates, self.watched(task, os.getppid())
                )
            else:
                os.environ[DISPOSABLE] = "1"
                runtime.skip_installed_fabs(self.holds)  # or Flower would unpack the bundle again for each message
                flower_internals.run_clientapp(self.address, token, self.root_certificates, parent_pid=os.getppid())
            code = 0
        except SystemExit as exit_:  # how Flower's runtime ends, with or without a reply
            code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        except BaseException:
            traceback.print_exc()
        finally:
            if self.done_fd is not None:  # the reply is with the SuperNode: it need not poll for it
                _notify(self.done_fd)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def watched(self, task, executor_pid: int) -> int:
        """The process whose end ends `task`'s process: a ServerApp's run ends with the SuperLink
        (`parent_pid`, when given), as with Flower's own executor; a ClientApp's with this executor."""
        if flower_internals.app_component(task) == "serverapp" and self.parent_pid is not None:
            return self.parent_pid
        return executor_pid

    def reap(self) -> None:
        """Collect finished children; say how any of them ended badly."""
        for pid, child in list(self.children.items()):
            if child.popen is not None:
                status, cpu = child.popen.poll(), None
            else:
                done, raw, usage = os.wait4(pid, os.WNOHANG)
                status, cpu = (
                    (os.waitstatus_to_exitcode(raw), usage.ru_utime + usage.ru_stime) if done else (None, None)
                )
            if status is None:
                continue
            del self.children[pid]
            if status != 0:
                how = f"killed by signal {-status}" if status < 0 else f"exited with status {status}"
                log.warning("task %d: %s process %d %s", child.task_id, child.kind, pid, how)
            elif cpu is not None:
                log.info("task %d: done in %.2f s (%.2f s CPU)", child.task_id, time.monotonic() - child.started, cpu)

    def close(self) -> None:
        """Stop every child (SIGTERM, then SIGKILL after STOP_GRACE seconds) and wait for them."""
        for pid in self.children:
            send(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        while self.children and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.05)
        for pid, child in self.children.items():
            send(pid, signal.SIGKILL)
            child.popen.wait() if child.popen else os.waitpid(pid, 0)
        self.children.clear()
        log.info("executor stopped after %d warm and %d stock tasks", self.served["warm"], self.served["stock"])


def closed(connection: socket.socket) -> bool:
    """Whether the other end of `connection` has closed it (or shut down its writing)."""
    if not select.select([connection], [], [], 0)[0]:
        return False
    try:
        return connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _notify(fd: int) -> None:
    try:
        os.write(fd, b"!")
    except OSError:  # nobody listens any more
        pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m florist.deploy.executor", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runtime-api-address", required=True, help="the SuperNode's (SuperLink's) Runtime API, HOST:PORT"
    )
    parser.add_argument("--root-certificates", help="CA of the Runtime API's TLS certificate (default: plain HTTP)")
    parser.add_argument(
        "--parent-pid",
        type=int,
        help="the SuperNode or SuperLink: a ServerApp's run ends with it; "
        "without a lifeline it must be our parent, and we exit when it is gone",
    )
    parser.add_argument("--wake-fd", type=int, help="pipe that becomes readable when the SuperNode pulled a message")
    parser.add_argument("--done-fd", type=int, help="pipe to tell the SuperNode a reply is ready")
    parser.add_argument(
        "--superexec-auth-secret-file",
        help="the SuperNode's (SuperLink's) SuperExec auth secret: task requests are signed with it",
    )
    parser.add_argument(
        "--app-dir",
        help="the app's publishable files, whose bundle is served warm (default: the checkout the app is imported "
        "from; give it where the app is installed as a package)",
    )
    parser.add_argument(
        "--app", default=DEFAULT_APP, help=f"the ClientApp to preload, module:attribute (default: {DEFAULT_APP})"
    )
    return parser.parse_args(argv)


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # One line per poll (httpx), and start-up chatter a node's user cannot act on: which of faiss's
    # builds this CPU loads (each one tried prints a ModuleNotFoundError), alembic's plugins, matplotlib's cache.
    for name in ("httpx", "faiss.loader", "alembic", "matplotlib"):
        logging.getLogger(name).setLevel(logging.WARNING)


def preload(ref: str, app_dir: str | None = None) -> PreloadedApp:
    """Everything a process does once before it forks children that run `ref`'s messages. On a
    Flower whose task runtime is not the one florist drives, it says so in one line and exits 1
    (`florist supernode` never starts it there: it runs Flower's own executor instead)."""
    if flower_internals.unusable("runtime"):
        raise SystemExit(f"florist: no warm executor on this Flower: {flower_internals.mismatch()}")
    app = PreloadedApp.load(ref, Path(app_dir) if app_dir else None)
    if not runtime.keep_app_folders_off_sys_path():  # inherited by every child
        log.warning("this Flower puts app folders on sys.path otherwise: no task is served warm")
        app = dataclasses.replace(app, bundle_hash=None, bundle_files={})
    flower_internals.quick_object_pulls()  # inherited by every child (off the fast path: no-ops, said once)
    gc.freeze()  # children never collect the preloaded objects, so they share their pages instead of copying them
    return app


def serve(args: argparse.Namespace, app: PreloadedApp, lifeline: socket.socket | None = None) -> int:
    """Serve the SuperNode that `args` name, with `app` preloaded, until stopped."""
    colours_for_terminals_only()  # a forked executor's stderr became its node's log just now
    try:
        secret = runtime.load_auth_secret(args.superexec_auth_secret_file)
    except ValueError as err:
        raise SystemExit(f"florist: {err}") from None
    where = (args.runtime_api_address, app, args.root_certificates, args.parent_pid)
    executor = WarmExecutor(*where, args.wake_fd, args.done_fd, lifeline, secret)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, executor.stop)
    log.info(
        "warm executor for %s (process %d, %d thread(s)) serving %s%s%s",
        app.ref,
        os.getpid(),
        os_threads(),
        args.runtime_api_address,
        ", signing its task requests" if secret else "",
        ", forked by the fork server" if lifeline else "",
    )
    executor.serve()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging()
    start = time.monotonic()
    app = preload(args.app, args.app_dir)
    log.info("%s: %d files preloaded in %.1f s", args.app, len(app.files), time.monotonic() - start)
    return serve(args, app)


if __name__ == "__main__":
    os.environ.update(THREAD_ENV)
    sys.exit(main())
