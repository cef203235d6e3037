"""Every use of Flower internals in florist, in one place, checked against the pinned release.

florist's deployment fast path needs what Flower 1.39 offers no setting for:

- a SuperNode sleeps 3 s after every pull that finds no message and 0.5 s between checks for
  its ClientApp's reply (`flwr/supernode/start_client_internal.py`): `pace_supernode` replaces
  those sleeps with a `Backoff` in that module only;
- whoever pulls a message's objects (SuperNode from SuperLink, ClientApp from SuperNode,
  ServerApp its replies) and finds one not pushed yet waits 1 s, then 2, 4, ... up to 10 s
  (`flwr/supercore/inflatable/inflatable_utils.py`); with fast polling that is the common
  case, so `quick_object_pulls` starts those waits at 10 ms, capped at 0.2 s (and bounds them
  by Flower's 2 h limit on the whole pull, not by 500 tries);
- the ServerApp's Grid takes replies off the SuperLink, then pulls their objects one reply after
  the other (`flwr/superlink/grid/http_grid.py`): a reply whose sender was cut off mid-upload
  would hold that poll for Flower's 2 h, and every reply behind it. `pull_replies` bounds each
  reply's pull by the round's deadline (the Grid then answers with an error whose reason starts
  with `HALF_UPLOADED`) and says when a poll has got that far, so that the next one can start
  beside it;
- a ClientApp process unpacks and re-verifies its app bundle for every message, even when that
  bundle is installed already (`flwr/cli/install.py`): `skip_installed_fabs` skips that;
- the warm executor drives the Runtime API's task loop and Flower's ClientApp and ServerApp
  runtimes itself (`runtime_client`, `acquire_task`, `stock_command`, `run_clientapp`,
  `run_serverapp`, as `flwr-clientapp` and `flwr-serverapp` call them);
- it reads the app bundles a SuperNode's ClientApps installed (`installed_fab`).

`verify()` checks that the installed Flower still has what these rely on; its test fails,
naming both Flower versions, when an upgrade changes any of it.
"""

from __future__ import annotations

import inspect
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from florist.common.pacing import Backoff

PINNED = "1.39.0"  # the Flower release everything below was read from
# How the ServerApp's Grid (`flwr/superlink/grid/http_grid.py`) words the error reply it makes
# for a reply whose objects could not all be pulled.
HALF_UPLOADED = "Reply message objects are unavailable"


def verify() -> None:
    """Raise RuntimeError naming what changed if the installed Flower is not what this module
    was written against."""
    import flwr
    from flwr.supernode import start_client_internal as sci
    from flwr.supernode.runtime.run_clientapp import run_clientapp as flower_run_clientapp

    problems = [] if flwr.__version__ == PINNED else [f"version {flwr.__version__}"]
    source = inspect.getsource(sci)
    problems += [f"no `{s}` in start_client_internal" for s in ("time.sleep(3)", "time.sleep(0.5)") if s not in source]
    problems += [
        f"no {n} in start_client_internal"
        for n in ("_pull_and_store_message", "_push_messages", "time")
        if not hasattr(sci, n)
    ]
    problems += [
        f"start_client_internal no longer calls {call}(... {keyword}=...)"
        for call, keyword in (("_pull_and_store_message", "receive"), ("_push_messages", "send"))
        if not re.search(rf"{call}\([^)]*\b{keyword}={keyword},", source)
    ]
    from flwr.supercore.inflatable import inflatable_utils

    for pull in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        keywords = ("initial_backoff", "backoff_cap", "max_tries_per_object", "max_time")
        if not set(keywords) <= set(pull.__kwdefaults__ or {}):
            problems.append(f"{pull.__name__} has no {'/'.join(keywords)} keywords")
    from flwr.superlink.grid import http_grid

    if HALF_UPLOADED not in inspect.getsource(http_grid):
        problems.append("the Grid no longer words a half-uploaded reply's error as florist reads it")
    pulls_objects = getattr(http_grid, "pull_objects", None) in (inflatable_utils.pull_objects, _bounded_pull_objects)
    if not pulls_objects or "= pull_objects(" not in inspect.getsource(http_grid.HttpGrid.pull_messages):
        problems.append("the Grid no longer pulls a reply's objects with pull_objects")
    from flwr.supernode.runtime import run_clientapp as runtime

    if "install_from_fab(fab.content, skip_prompt=True)" not in inspect.getsource(runtime):
        problems.append("run_clientapp no longer installs the FAB with install_from_fab")
    expected = ["runtime_api_address", "token", "insecure", "certificates", "parent_pid", "runtime_dependency_install"]
    if list(inspect.signature(flower_run_clientapp).parameters) != expected:
        problems.append("run_clientapp's parameters changed")
    from flwr.superlink.cli import flwr_serverapp
    from flwr.superlink.runtime import run_serverapp as flower_run_serverapp

    expected = [
        "runtime_api_address",
        "log_queue",
        "token",
        "insecure",
        "certificates",
        "parent_pid",
        "runtime_dependency_install",
    ]
    if list(inspect.signature(flower_run_serverapp).parameters) != expected:
        problems.append("run_serverapp's parameters changed")
    if "mirror_output_to_queue(log_queue)" not in inspect.getsource(flwr_serverapp):
        problems.append("flwr-serverapp no longer mirrors its output with mirror_output_to_queue")
    if problems:
        raise RuntimeError(
            f"florist's deployment fast path was written for Flower {PINNED}; the installed Flower "
            f"{flwr.__version__} differs: {'; '.join(problems)}"
        )


class _PacedTime:
    """Stands in for the `time` module inside `start_client_internal`: its fixed sleeps become
    `Backoff` delays (never longer than what Flower asked for), cut short by `wake`."""

    def __init__(self, backoff: Backoff, wake: threading.Event):
        self.backoff, self.wake = backoff, wake

    def sleep(self, seconds: float) -> None:
        self.wake.wait(min(seconds, self.backoff.delay()))
        self.wake.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def quick_object_pulls() -> None:
    """In this process, retry an object that is not there yet after 10 ms, doubling up to
    0.2 s (instead of 1 s doubling up to 10 s)."""
    verify()
    from flwr.supercore.inflatable import inflatable_utils

    for pull in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        pull.__kwdefaults__.update(initial_backoff=0.01, backoff_cap=0.2, max_tries_per_object=None)


_poll = threading.local()  # the bounds and hook of the `pull_replies` this thread runs


def pull_replies(
    grid: Any, message_ids: list[str], until: float, at_least: float, on_objects: Callable[[], None] = lambda: None
) -> list[Any]:
    """`grid.pull_messages(message_ids)`, except that the deployment Grid gives up on a reply
    whose objects are not all there at `until` (`time.monotonic()`), though never sooner than
    `at_least` seconds after it starts pulling them, and calls `on_objects()` whenever it starts:
    by then the replies it returns are off the SuperLink, so another poll cannot get them too.
    (Other Grids hold replies whole and never call it.)"""
    http_grid = sys.modules.get("flwr.superlink.grid.http_grid")  # not imported: not the deployment Grid
    if http_grid is not None and getattr(http_grid, "pull_objects", None) is not _bounded_pull_objects:
        verify()
        http_grid.pull_objects = _bounded_pull_objects
    _poll.until, _poll.at_least, _poll.on_objects = until, at_least, on_objects
    try:
        return list(grid.pull_messages(message_ids))
    finally:
        del _poll.until


def _bounded_pull_objects(*args: Any, **kwargs: Any) -> Any:
    """Flower's `pull_objects`, as the Grid calls it, within the bounds of this thread's poll."""
    from flwr.supercore.inflatable import inflatable_utils

    if (until := getattr(_poll, "until", None)) is not None:
        _poll.on_objects()
        kwargs["max_time"] = max(until - time.monotonic(), _poll.at_least)
    return inflatable_utils.pull_objects(*args, **kwargs)


def skip_installed_fabs() -> None:
    """In this process, Flower's ClientApp runtime installs an app bundle only when it is not
    installed already (it would unpack and hash every file again for every message)."""
    verify()
    import hashlib

    from flwr.supernode.runtime import run_clientapp as runtime

    install = runtime.install_from_fab

    def install_once(fab_file: bytes, skip_prompt: bool = False) -> Path:
        return installed_fab(hashlib.sha256(fab_file).hexdigest()) or install(fab_file, skip_prompt=skip_prompt)

    runtime.install_from_fab = install_once


def pace_supernode(
    backoff: Backoff, wake: threading.Event | None = None, on_message: Callable[[], None] | None = None
) -> None:
    """Make this process's SuperNode poll with `backoff`, reset whenever a message arrives and
    when its reply has gone out, and pull objects quickly. Setting `wake` ends a wait at once
    (e.g. when a reply is there); `on_message` is called for every message pulled.

    Also, the reply to the message just pulled is always pushed before the next pull: Flower
    pushes whatever replies are there, and a reply left over from a message it gave up on (its
    run ended while the node was cut off) would otherwise go out in its place, the new reply
    left unsent until the next message comes, which the server sends only after it has given up
    waiting for this reply."""
    quick_object_pulls()
    from flwr.supernode import start_client_internal as sci

    pull, push = sci._pull_and_store_message, sci._push_messages
    pulled: list[str] = []  # the id of the message the last pull stored, until its reply is pushed

    def pull_and_store(*args: Any, receive: Callable[[], Any], **kwargs: Any) -> int | None:
        def receive_one() -> Any:
            if (got := receive()) is not None:
                pulled.append(got[0].metadata.message_id)
            return got

        pulled.clear()
        run_id = pull(*args, receive=receive_one, **kwargs)
        if run_id is None:  # nothing came, or Flower dropped what did
            pulled.clear()
        else:
            backoff.reset()
            if on_message:
                on_message()
        return run_id

    def push_replies(*args: Any, send: Callable[..., Any], **kwargs: Any) -> None:
        replied: set[str] = set()

        def send_one(message: Any, *rest: Any) -> Any:
            replied.add(message.metadata.reply_to_message_id)  # sent, or refused: either way it is gone
            return send(message, *rest)

        try:
            push(*args, send=send_one, **kwargs)
            while not replied.issuperset(pulled):
                push(*args, send=send_one, **kwargs)
        finally:
            pulled.clear()
            backoff.reset()

    sci._pull_and_store_message, sci._push_messages = pull_and_store, push_replies
    sci.time = _PacedTime(backoff, wake or threading.Event())


def supernode_main(argv: list[str]) -> None:
    """Flower's `flower-supernode` with these arguments, in this process."""
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *argv]
    flower_supernode()


def runtime_client(address: str, root_certificates: str | None):
    """A client of a SuperNode's Runtime API, as Flower's SuperExec makes it (no retries:
    the executor's own loop decides what to do when the SuperNode is gone)."""
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
    from flwr.supercore.runtime import RuntimeHttpClient

    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=root_certificates is None,
        root_certificates=root_certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec")],
    )


def acquire_task(client) -> tuple[str, Any] | None:
    """(token, task) of the next pending task of any type, or None."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType

    response = client.AcquireTask(AcquireTaskRequest(supported_task_types=[str(t) for t in TaskType]))
    return (response.token, response.task) if response.HasField("task") and response.token else None


def app_component(task) -> str | None:
    """ "clientapp" or "serverapp" (its key in [tool.flwr.app.components]) for a task that runs
    one, None for any other (a simulation)."""
    from flwr.supercore.constant import TaskType

    return {TaskType.CLIENT_APP: "clientapp", TaskType.SERVER_APP: "serverapp"}.get(task.type)


def stock_command(task, address: str, token: str, root_certificates: str | None, parent_pid: int) -> list[str]:
    """The process Flower's own SuperExec starts for `task` (`SubprocessExecutor.launch`)."""
    from flwr.supercore.constant import TASK_TYPE_TO_APPIO_API_ADDRESS_ARG, TASK_TYPE_TO_COMMAND, TaskType

    task_type = TaskType(task.type)
    command = [
        TASK_TYPE_TO_COMMAND[task_type],
        TASK_TYPE_TO_APPIO_API_ADDRESS_ARG[task_type],
        address,
        "--token",
        token,
    ]
    command += ["--root-certificates", root_certificates] if root_certificates else ["--insecure"]
    return command + ["--parent-pid", str(parent_pid)]


def run_clientapp(address: str, token: str, root_certificates: str | None, parent_pid: int) -> None:
    """Flower's ClientApp runtime for one task: pull its message, run the ClientApp the run's
    app bundle names, push the reply, exit. An app module already imported in this process is
    used as it is (`flwr.supercore.object_ref.load_app`), which is what makes a forked child warm."""
    from flwr.supernode.runtime.run_clientapp import run_clientapp as flower_run_clientapp

    certificates = Path(root_certificates).read_bytes() if root_certificates else None
    flower_run_clientapp(
        runtime_api_address=address,
        token=token,
        insecure=certificates is None,
        certificates=certificates,
        parent_pid=parent_pid,
        runtime_dependency_install=False,
    )


def run_serverapp(address: str, token: str, root_certificates: str | None, parent_pid: int) -> None:
    """Flower's ServerApp runtime for one run, as `flwr-serverapp` calls it: its output is
    mirrored to the SuperLink (what `flwr run --stream` and `flwr log` show), the run's
    ServerApp runs, the process ends when `parent_pid` does."""
    import logging
    from queue import Queue

    from flwr.supercore.logger import mirror_output_to_queue, restore_output
    from flwr.superlink.runtime import run_serverapp as flower_run_serverapp

    logging.getLogger().handlers.clear()  # the executor's handler would write each of Flower's lines twice
    log_queue: Queue[str | None] = Queue()
    mirror_output_to_queue(log_queue)
    certificates = Path(root_certificates).read_bytes() if root_certificates else None
    try:
        flower_run_serverapp(
            runtime_api_address=address,
            log_queue=log_queue,
            token=token,
            insecure=certificates is None,
            certificates=certificates,
            parent_pid=parent_pid,
            runtime_dependency_install=False,
        )
    finally:
        restore_output()


def installed_fab(fab_hash: str) -> Path | None:
    """The folder where this machine's ClientApps installed the app bundle `fab_hash`
    (`$FLWR_HOME/apps/<publisher>.<name>.<version>.<hash prefix>`), if one did."""
    from flwr.common.constant import APP_DIR, FAB_HASH_TRUNCATION
    from flwr.supercore.utils import get_flwr_home

    found = sorted((get_flwr_home() / APP_DIR).glob(f"*.{fab_hash[:FAB_HASH_TRUNCATION]}"))
    return found[0] if fab_hash and found else None


def online_node_ids(address: str, root_certificates: str | None) -> list[int]:
    """The SuperNodes the SuperLink at `address` (its Control API) lists as online: what
    `flwr supernode list` asks, without starting the CLI (2-3 CPU-seconds per call)."""
    from flwr.proto.control_pb2 import ListNodesRequest
    from flwr.supercore.control import ControlHttpClient
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor

    client = ControlHttpClient.from_server_address(
        server_address=address,
        insecure=root_certificates is None,
        root_certificates=root_certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr CLI")],
    )
    try:
        return sorted(n.node_id for n in client.ListNodes(ListNodesRequest()).nodes_info if n.status == "online")
    finally:
        client.close()


def publishable_files(root: Path) -> dict[str, Path]:
    """The files of the app in `root` that `flwr run` puts in its app bundle, by Flower's own
    rules (.gitignore, Flower's include and exclude lists), found without entering the folders
    .gitignore excludes: Flower walks and matches every file first, which in a checkout with
    its .venv (49k files) costs 8 CPU-seconds per `flwr run`."""
    import os

    from flwr.cli.utils import build_pathspec, filter_paths_for_publish, load_gitignore_patterns

    ignore = root / ".gitignore"
    ignored = build_pathspec(tuple(load_gitignore_patterns(ignore.read_bytes() if ignore.is_file() else b"")))
    files: dict[str, Path] = {}
    for folder, subfolders, names in os.walk(root):
        here = Path(folder).relative_to(root)
        subfolders[:] = [
            d
            for d in subfolders
            if not Path(folder, d).is_symlink() and not ignored.match_file(f"{(here / d).as_posix()}/")
        ]
        files |= {(here / n).as_posix(): Path(folder, n) for n in names if not Path(folder, n).is_symlink()}
    return filter_paths_for_publish(files)


def fab_bytes(root: Path) -> bytes:
    """The app bundle `flwr run ROOT` would build, byte for byte (same files, same dates)."""
    from flwr.cli.build import build_fab_from_files

    return build_fab_from_files(publishable_files(root))[0]
