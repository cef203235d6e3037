"""One preloaded process that forks the warm executor of every SuperNode on this machine.

A warm executor (`executor.py`) imports torch, flwr and florist and warms them up before it
serves its SuperNode: about 10 s of CPU and 1 GB of memory on a 2-core machine. A federation of
N SuperNodes on one machine (`florist deploy-local`) would pay that N times; the fork server
pays it once and forks each SuperNode's executor from its preloaded state, whose memory pages
the executors then share.

A SuperNode (or, for the SuperLink's ServerApps, `LocalFederation`) asks for its executor
with `request` over a Unix socket: it sends the executor's arguments, its log and a SuperNode's
two pipes (SCM_RIGHTS), and gets the executor's PID back. The connection stays open as the
executor's lifeline: the executor stops when the asker shuts it down or dies, and the asker
sees its executor gone when the connection reads EOF. Like the executor, this process starts
no thread, so forking it is safe.

    python -m florist.deploy.forkserver --socket PATH [--app MODULE:APP] [--parent-pid PID]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback

from florist.deploy import executor

log = logging.getLogger("florist.forkserver")

MAX_REQUEST = 1 << 16  # bytes of one request's arguments (a few hundred in practice)


class Forked:
    """An executor that the fork server started for us: not our child, so watched through its
    lifeline. Quacks like the `subprocess.Popen` that `SupervisedExecutor` keeps. Its PID comes
    when the fork server has preloaded (`answer` waits for it)."""

    def __init__(self, connection: socket.socket):
        self.connection, self.returncode, self._pid = connection, None, None
        self.refused = False  # the fork server closed the connection without forking

    @property
    def pid(self) -> int:
        return self.answer()

    def answer(self, timeout: float = 120.0) -> int:
        """The executor's PID, once the fork server has forked it (`timeout` covers its own
        preloading when it has only just started); ConnectionError if it refused."""
        if self._pid is None:
            self.connection.settimeout(timeout)
            answer = b""
            while not answer.endswith(b"\n"):
                if not (chunk := self.connection.recv(64)):
                    raise ConnectionError("the fork server closed the connection")
                answer += chunk
            self.connection.settimeout(None)
            self._pid = int(answer)
        return self._pid

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                if self._pid is None and select.select([self.connection], [], [], 0)[0]:
                    self.answer()
                gone = self._pid is not None and executor.closed(self.connection)
            except (OSError, ValueError):  # refused, or broken before it answered
                gone = self.refused = True
            if gone:
                self.returncode = 0  # its status is its parent's, the fork server's, to collect
                self.connection.close()
        return self.returncode

    def terminate(self) -> None:
        """Let go of the lifeline: the executor stops its children and exits."""
        if self.returncode is None:
            self.connection.shutdown(socket.SHUT_WR)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"executor {self._pid}", timeout)
            select.select([self.connection], [], [], left)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None and self._pid is not None:
            os.kill(self._pid, signal.SIGKILL)


def request(path: str, argv: list[str], log_fd: int, pipes: tuple[int, int] | None = None) -> Forked:
    """Ask the fork server at `path` for a warm executor with `argv` (executor.py's options,
    less the pipes), its output going to `log_fd`; `pipes` are a SuperNode's wake and done
    pipes. Returns at once: `Forked.answer` waits for the fork."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(10.0)  # the fork server listens before it preloads
        connection.connect(path)
        socket.send_fds(connection, [json.dumps(argv).encode()], [log_fd, *(pipes or ())])
        return Forked(connection)
    except BaseException:
        connection.close()
        raise


def listen(path: str) -> socket.socket:
    """A listener at `path` that only this user can connect to: the socket file is made 0600
    before it listens (until then a connection is refused), then given its name."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{path}.new")
    os.chmod(f"{path}.new", 0o600)
    listener.listen(64)
    os.rename(f"{path}.new", path)  # only a listening socket has the name: no refused connection
    return listener


def peer_uid(connection: socket.socket) -> int | None:
    """The user id of the process at the other end of a Unix socket (None where the system
    does not tell: then the socket's mode alone keeps others out)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    _, uid, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def accept(listener: socket.socket) -> socket.socket | None:
    """The next connection, if it comes from this user; another user's is closed, in one log line."""
    connection, _ = listener.accept()
    uid = peer_uid(connection)
    if uid is not None and uid != os.getuid():
        log.warning(
            "refused a connection from uid %d: this fork server forks executors for uid %d only", uid, os.getuid()
        )
        connection.close()
        return None
    return connection


class ForkServer:
    def __init__(self, app: executor.PreloadedApp, parent_pid: int | None):
        self.app, self.parent_pid = app, parent_pid
        self.stopping = False

    def stop(self, *_: object) -> None:
        self.stopping = True

    def serve(self, listener: socket.socket) -> None:
        """Fork an executor per request until stopped or the process that started us is gone."""
        while not self.stopping and (self.parent_pid is None or os.getppid() == self.parent_pid):
            _reap()
            if select.select([listener], [], [], 1.0)[0] and (connection := accept(listener)):
                try:
                    self.fork(listener, connection)
                except (OSError, ValueError) as err:  # a malformed or vanished request: the next one is served
                    log.warning("a request for an executor failed: %s", err)
                finally:
                    connection.close()

    def fork(self, listener: socket.socket, connection: socket.socket) -> None:
        message, fds, _, _ = socket.recv_fds(connection, MAX_REQUEST, 3)
        try:
            if len(fds) not in (1, 3):
                raise ValueError(f"expected 1 or 3 file descriptors (log, and wake and done), got {len(fds)}")
            argv = [str(a) for a in json.loads(message)]
            argv += ["--wake-fd", str(fds[1]), "--done-fd", str(fds[2])] if len(fds) == 3 else []
            args = executor.parse_args(argv)
            if args.app != self.app.ref:
                raise ValueError(f"a request for {args.app}: this fork server preloaded {self.app.ref}")
            pid = os.fork()
            if pid == 0:
                listener.close()
                self._become_executor(args, connection, fds[0])
            connection.sendall(f"{pid}\n".encode())
            log.info("executor %d forked for %s", pid, args.runtime_api_address)
        finally:  # the child has its own copies
            for fd in fds:
                os.close(fd)

    def _become_executor(self, args: argparse.Namespace, lifeline: socket.socket, log_fd: int) -> None:
        code = 1
        try:  # the child: never returns into the fork server's loop
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            os.dup2(log_fd, sys.stdout.fileno())
            os.dup2(log_fd, sys.stderr.fileno())
            os.close(log_fd)
            code = executor.serve(args, self.app, lifeline)
        except SystemExit as refusal:  # a user's mistake (an unreadable secret file): one line
            print(refusal, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _reap() -> None:
    """Collect the executors that have exited."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m florist.deploy.forkserver", description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", required=True, help="the Unix socket to listen on (created; removed on exit)")
    parser.add_argument("--app", default=executor.DEFAULT_APP, help="the ClientApp to preload, module:attribute")
    parser.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    args = parser.parse_args(argv)
    executor.configure_logging()
    listener = listen(args.socket)  # before preloading: SuperNodes that connect meanwhile wait in the backlog
    try:
        start = time.monotonic()
        server = ForkServer(executor.preload(args.app), args.parent_pid)
        for sig in (signal.SIGTERM, signal.SIGINT):  # while preloading, they end it at once
            signal.signal(sig, server.stop)
        log.info(
            "fork server for %s: %d files preloaded in %.1f s, %d thread(s), listening on %s",
            args.app,
            len(server.app.files),
            time.monotonic() - start,
            executor.os_threads(),
            args.socket,
        )
        server.serve(listener)
    finally:
        listener.close()
        os.unlink(args.socket)
    return 0


if __name__ == "__main__":
    os.environ.update(executor.THREAD_ENV)
    sys.exit(main())
