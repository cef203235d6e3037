"""Finding and stopping the processes florist started, and nothing else.

Every process tree florist starts carries a marker in its environment (a private FLWR_HOME
for a federation, FLORIST_RUN for a simulation), which children inherit: Ray's workers, a
SuperNode's executor and its ClientApps. Stopping by marker reaches all of them, even those
that left the process group they were started in; stopping their descendants too reaches the
few started with an environment of their own.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def marked(variable: str, value: str, parents: dict[int, int] | None = None) -> list[int]:
    """Live processes whose environment has `variable=value` (Linux; empty elsewhere), except
    this one and its ancestors: a shell that exported the same value is not ours to stop.
    `parents`: a `_parents()` already read, to save reading it again."""
    marker, pids, ours = f"{variable}={value}".encode(), [], _self_and_ancestors(parents or _parents())
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            if marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                pids.append(int(pid))
        except OSError:
            continue
    return [pid for pid in pids if pid not in ours]


def descendants(pids: list[int], parents: dict[int, int] | None = None) -> list[int]:
    """Every live process below `pids` in the process tree (Linux; empty elsewhere). Not all of
    them carry the marker: Ray's raylet starts its dashboard and runtime-env agents with an
    environment of its own, and once the raylet is gone nothing else leads to them."""
    children: dict[int, list[int]] = {}
    for pid, parent in (parents or _parents()).items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def _parents() -> dict[int, int]:
    """The parent of every live process, by pid (Linux; empty elsewhere)."""
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:  # "pid (command) state ppid ...": the command may hold spaces and parentheses
            parents[int(pid)] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return parents


def _self_and_ancestors(parents: dict[int, int]) -> set[int]:
    chain, pid = set(), os.getpid()
    while pid > 0 and pid not in chain:
        chain.add(pid)
        pid = parents.get(pid, 0)
    return chain


def terminate(pids: list[int], grace: float = 3.0) -> None:
    """SIGTERM to each of `pids`, SIGKILL to those still there after `grace` seconds, then
    wait (at most 3 s) until they are gone."""
    for pid in pids:
        send(pid, signal.SIGTERM)
    _wait_until_gone(pids, grace)
    for pid in filter(alive, pids):  # not a pid that has gone and may be another process's now
        send(pid, signal.SIGKILL)
    _wait_until_gone(pids, 3.0)  # a killed process that held much memory can take a while to go, under load


def terminate_marked(variable: str, value: str, pids: list[int] = (), grace: float = 3.0, quiet: float = 0.2) -> None:
    """`terminate` `pids`, every process marked `variable=value` and all their descendants, again
    until none is left (a process may start another while the first ones are stopping; at most
    five passes). None is left only when looks every 0.1 s for `quiet` seconds find none: a
    process in the middle of `exec` hides its environment, and Ray's workers fork new ones while
    they are being stopped."""

    def started() -> list[int]:
        parents = _parents()
        found = [*pids, *marked(variable, value, parents)]
        return found + [pid for pid in descendants(found, parents) if pid not in found]

    for _ in range(5):
        found, calm_until = started(), time.monotonic() + quiet
        while not found and time.monotonic() < calm_until:
            time.sleep(0.1)
            found = started()
        if not found:
            return
        terminate(found, grace)
        pids = []


def _wait_until_gone(pids: list[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie does not); reaps it if it is this process's child."""
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # there, but not ours to signal
        return True
    try:  # a zombie (another parent's, not reaped yet) is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return True


def send(pid: int, sig: int) -> None:
    """`sig` to `pid`, if it still exists and is ours to signal (a setuid child may not be)."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
