"""Every use of Flower internals in florist, in one place, checked against the pinned release.

florist's deployment fast path needs what Flower 1.39 offers no setting for
(docs/flower-internals.md has the table: what each use is, where in Flower, what it buys, what
runs instead on another Flower, what would replace it):

- `supernode.py`: the SuperNode's paced polling (`pace_supernode`), quick object pulls
  (`quick_object_pulls`) and the ServerApp's bounded reply pulls (`pull_replies`);
- `simulation.py`: the simulation engine's pickup of pushed messages (`quick_pickup`);
- `runtime.py`: the warm executor's use of the Runtime API and of Flower's ClientApp and
  ServerApp runtimes, the app bundles a SuperNode installed (`installed_fab`, `skip_installed_fabs`),
  the Control API's node list (`online_node_ids`) and the files `flwr run` bundles
  (`publishable_files`, `fab_bytes`);
- here: the guard, and the few internals an in-process run needs (`server_identity`,
  `assign_message_id`) and an exchange reads (`half_uploaded`).

The guard: `mismatch()` says (once per process, cached) how the installed Flower differs from
the one all this was read from, `fast_path()` answers whether to use it, saying once per process
that it does not. Whatever it gates falls back to Flower's stock path: nothing refuses to run.
In-process runs use no patched code; a simulation's one patch (`quick_pickup`) falls back
without a word. `verify()` raises
instead: its test pins the version, and fails naming both when an upgrade changes anything here.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

PINNED = "1.39.0"  # the Flower release everything here was read from
# How the ServerApp's Grid (`flwr/superlink/grid/http_grid.py`) words the error reply it makes
# for a reply whose objects could not all be pulled.
HALF_UPLOADED = "Reply message objects are unavailable"
# What `supernode._capped` makes the Grid's reason for such a reply end with, when a reply's
# objects passed its size cap: "<OVERSIZED> <bytes> bytes pulled, cap <bytes> bytes".
OVERSIZED = "florist: over its size cap:"


def _supernode() -> list[str]:
    """What `pace_supernode` replaces in the SuperNode's loop."""
    from flwr.supernode import start_client_internal as sci

    source = inspect.getsource(sci)
    problems = [f"no `{s}` in start_client_internal" for s in ("time.sleep(3)", "time.sleep(0.5)") if s not in source]
    problems += [
        f"no {n} in start_client_internal"
        for n in ("_pull_and_store_message", "_push_messages", "time")
        if not hasattr(sci, n)
    ]
    return problems + [
        f"start_client_internal no longer calls {call}(... {keyword}=...)"
        for call, keyword in (("_pull_and_store_message", "receive"), ("_push_messages", "send"))
        if not re.search(rf"{call}\([^)]*\b{keyword}={keyword},", source)
    ]


def _object_pulls() -> list[str]:
    """The keywords whose defaults `quick_object_pulls` changes."""
    from flwr.supercore.inflatable import inflatable_utils

    keywords = ("initial_backoff", "backoff_cap", "max_tries_per_object", "max_time")
    return [
        f"{pull.__name__} has no {'/'.join(keywords)} keywords"
        for pull in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree)
        if not set(keywords) <= set(pull.__kwdefaults__ or {})
    ]


def _grid() -> list[str]:
    """How the deployment Grid pulls a reply's objects (`pull_replies`) and words a half upload."""
    from flwr.supercore.inflatable import inflatable_utils
    from flwr.superlink.grid import http_grid

    from florist.common.flower_internals.supernode import _bounded_pull_objects

    problems = []
    if HALF_UPLOADED not in inspect.getsource(http_grid):
        problems.append("the Grid no longer words a half-uploaded reply's error as florist reads it")
    pulls_objects = getattr(http_grid, "pull_objects", None) in (inflatable_utils.pull_objects, _bounded_pull_objects)
    pull = inspect.getsource(http_grid.HttpGrid.pull_messages)
    if not pulls_objects or "= pull_objects(" not in pull:
        problems.append("the Grid no longer pulls a reply's objects with pull_objects")
    if "pull_object_fn=" not in pull or "except ObjectPullError as e" not in pull or "{e}" not in pull:
        problems.append("the Grid no longer turns a failed pull_object_fn into an error reply naming its reason")
    return problems + _objects()


def _objects() -> list[str]:
    """How `supernode._weigh` reads a pulled object: its type, and an Array's chunk list."""
    from flwr.app import Array
    from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE  # noqa: F401
    from flwr.supercore.inflatable.inflatable_object import get_object_body, get_object_type_from_object_content

    content = Array(dtype="float32", shape=(1,), stype="numpy.ndarray", data=bytes(4)).deflate()
    if get_object_type_from_object_content(content) != "Array" or b'"arraychunk_ids"' not in get_object_body(
        content, Array
    ):
        return ["an Array object no longer lists its chunks as florist reads them"]
    return []


def _fab() -> list[str]:
    """Where ClientApps install app bundles, and how (`installed_fab`, `skip_installed_fabs`)."""
    from flwr.common.constant import APP_DIR, FAB_HASH_TRUNCATION  # noqa: F401
    from flwr.supercore.utils import get_flwr_home  # noqa: F401
    from flwr.supernode.runtime import run_clientapp as runtime

    if "install_from_fab(fab.content, skip_prompt=True)" not in inspect.getsource(runtime):
        return ["run_clientapp no longer installs the FAB with install_from_fab"]
    return []


def _runtime() -> list[str]:
    """What the warm executor drives: the Runtime API's task loop, Flower's app runtimes."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest  # noqa: F401
    from flwr.supercore.auth import load_superexec_auth_secret  # noqa: F401
    from flwr.supercore.constant import TASK_TYPE_TO_APPIO_API_ADDRESS_ARG, TASK_TYPE_TO_COMMAND, TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor, SuperExecAuthHttpInterceptor  # noqa: F401
    from flwr.supercore.logger import mirror_output_to_queue, restore_output  # noqa: F401
    from flwr.supercore.object_ref import load_app
    from flwr.supercore.runtime import RuntimeHttpClient  # noqa: F401
    from flwr.superlink.cli import flwr_serverapp
    from flwr.superlink.runtime import run_serverapp
    from flwr.supernode.cli import flower_supernode  # noqa: F401
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    problems = []
    if "_ensure_sys_path(project_dir)" not in inspect.getsource(load_app):
        problems.append("load_app no longer puts the app folder on sys.path with _ensure_sys_path")
    if not {TaskType.CLIENT_APP, TaskType.SERVER_APP} <= set(TASK_TYPE_TO_COMMAND) & set(
        TASK_TYPE_TO_APPIO_API_ADDRESS_ARG
    ):
        problems.append("the SuperExec's task commands changed")
    common = ["token", "insecure", "certificates", "parent_pid", "runtime_dependency_install"]
    if list(inspect.signature(run_clientapp).parameters) != ["runtime_api_address", *common]:
        problems.append("run_clientapp's parameters changed")
    if list(inspect.signature(run_serverapp).parameters) != ["runtime_api_address", "log_queue", *common]:
        problems.append("run_serverapp's parameters changed")
    if "mirror_output_to_queue(log_queue)" not in inspect.getsource(flwr_serverapp):
        problems.append("flwr-serverapp no longer mirrors its output with mirror_output_to_queue")
    return problems


def _control() -> list[str]:
    """The Control API client `online_node_ids` asks."""
    from flwr.proto.control_pb2 import ListNodesRequest  # noqa: F401
    from flwr.supercore.control import ControlHttpClient  # noqa: F401

    return []


def _publish() -> list[str]:
    """Flower's rules for the files `flwr run` bundles (`publishable_files`, `fab_bytes`)."""
    from flwr.cli.build import build_fab_from_files  # noqa: F401
    from flwr.cli.utils import build_pathspec, filter_paths_for_publish, load_gitignore_patterns  # noqa: F401

    return []


def _simulation() -> list[str]:
    """The simulation engine's extractor, which `quick_pickup` replaces, and how it is started."""
    from flwr.server.superlink.fleet.vce import vce_api

    source = inspect.getsource(vce_api)
    wanted = ("target=add_messages_to_queue", "state.get_message_ins(node_id=node_id, limit=1)", "f_stop.wait(0.1)")
    problems = [f"vce_api no longer has `{text}`" for text in wanted if text not in source]
    if "def add_messages_to_queue(\n    state: LinkState,\n    queue: Queue[Message],\n    nodes_mapping" not in source:
        problems.append("vce_api.add_messages_to_queue's parameters changed")
    if "state_factory.state()" not in inspect.getsource(vce_api.run_api):
        problems.append("the simulation engine no longer reads the one LinkState of its factory")
    return problems


def _identity() -> list[str]:
    """The task identity and message id an in-process run sets (`server_identity`, `assign_message_id`)."""
    from flwr.app import Metadata
    from flwr.supercore.task_identity import TaskIdentity

    problems = [
        f"TaskIdentity has no {n}" for n in ("task_id", "run_id", "node_id") if not hasattr(type(TaskIdentity), n)
    ]
    if 'self.__dict__["_message_id"]' not in inspect.getsource(Metadata.message_id.fget):
        problems.append("Metadata no longer keeps message_id as _message_id")
    return problems


# What each area of florist's use of Flower relies on (`unusable(area)`).
CHECKS: dict[str, Callable[[], list[str]]] = {
    "supernode": _supernode,
    "object pulls": _object_pulls,
    "grid": _grid,
    "fab": _fab,
    "runtime": _runtime,
    "control": _control,
    "publish": _publish,
    "identity": _identity,
    "simulation": _simulation,
}


def installed() -> str:
    import flwr

    return str(getattr(flwr, "__version__", "unknown"))


def _differences() -> list[tuple[str, str]]:
    """(area, what differs) for everything the installed Flower lacks: a check that fails (a module
    moved, a name gone) is a difference too."""
    found = []
    for area, check in CHECKS.items():
        try:
            found += [(area, problem) for problem in check()]
        except Exception as err:
            found.append((area, f"{area}: {type(err).__name__}: {err}"))
    return found


@functools.cache
def differences() -> tuple[tuple[str, str], ...]:
    """`_differences()`, worked out once per process."""
    return tuple(_differences())


@functools.cache
def mismatch() -> str | None:
    """None on the pinned Flower with everything florist uses of it; else one line naming the
    installed and the pinned version and what differs."""
    version, found = installed(), [problem for _, problem in differences()]
    if version == PINNED and not found:
        return None
    what = "; ".join(found) if found else "the internals it checks are unchanged"
    return f"Flower {version} is installed, florist's fast path was written for {PINNED} ({what})"


def unusable(area: str) -> list[str]:
    """What the installed Flower lacks of what `area` (a key of CHECKS) relies on."""
    return [problem for where, problem in differences() if where == area]


_warned = threading.Event()
_warning = threading.Lock()


def fast_path() -> bool:
    """Whether to use florist's fast path: on the pinned Flower only. The first time it says no,
    it says so on stderr in one line (a ServerApp's stderr streams to `flwr run --stream`)."""
    why = mismatch()
    if why is not None and not _warned.is_set():
        with _warning:
            if not _warned.is_set():
                print(f"florist: {why}: using Flower's stock paths", file=sys.stderr, flush=True)
                _warned.set()
    return why is None


def forget() -> None:
    """Work everything out again, and warn again (for tests that change Flower under the guard)."""
    differences.cache_clear()
    mismatch.cache_clear()
    _warned.clear()


def verify() -> None:
    """Raise RuntimeError naming what changed if the installed Flower is not what this package
    was written against (worked out afresh on every call)."""
    version = installed()
    problems = ([f"version {version}"] if version != PINNED else []) + [p for _, p in _differences()]
    if problems:
        raise RuntimeError(
            f"florist's deployment fast path was written for Flower {PINNED}; the installed Flower "
            f"{version} differs: {'; '.join(problems)}"
        )


def half_uploaded(error: Any) -> bool:
    """Whether `error` (a reply's `Error`) is the one the deployment Grid makes for a reply whose
    objects could not all be pulled (on a Flower that words it otherwise, such a reply reads as
    an expired message)."""
    from flwr.common.constant import ErrorCode

    return error.code == ErrorCode.MESSAGE_UNAVAILABLE and error.reason.startswith(HALF_UPLOADED)


def oversized(error: Any) -> tuple[int, int] | None:
    """(bytes pulled, cap) when `error` (a reply's `Error`) is the deployment Grid's for a
    reply whose objects were no longer pulled once they passed the exchange's size cap
    (`supernode.pull_replies`); else None."""
    found = re.search(rf"{re.escape(OVERSIZED)} (\d+) bytes pulled, cap (\d+) bytes", error.reason)
    return (int(found[1]), int(found[2])) if half_uploaded(error) and found else None


@contextlib.contextmanager
def server_identity(run_id: int) -> Iterator[None]:
    """Flower's messages take their sender from the task identity a runtime sets for the
    ServerApp; set it for the block and restore it after (unset reads raise, so unset is None)."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    def current(name: str) -> int | None:
        try:
            return getattr(TaskIdentity, name)
        except RuntimeError:  # not set
            return None

    saved = {name: current(name) for name in ("task_id", "run_id", "node_id")}
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(TaskIdentity, name, value)


def assign_message_id(message: Any) -> str:
    """Give `message` the id the SuperLink would (its object id; Flower's in-memory Grid writes it
    the same way: `Metadata` has no setter for it). Returns the id."""
    message.metadata.__dict__["_message_id"] = message.object_id
    return message.metadata.message_id


# The rest of the public names, for `from florist.common import flower_internals`.
from florist.common.flower_internals.runtime import (  # noqa: E402
    acquire_task,
    app_component,
    fab_bytes,
    installed_fab,
    node_infos,
    online_node_ids,
    publishable_files,
    run_clientapp,
    run_serverapp,
    runtime_client,
    skip_installed_fabs,
    stock_command,
)
from florist.common.flower_internals.supernode import (  # noqa: E402
    pace_supernode,
    pull_replies,
    quick_object_pulls,
    supernode_main,
)

__all__ = [
    "CHECKS",
    "HALF_UPLOADED",
    "OVERSIZED",
    "PINNED",
    "acquire_task",
    "app_component",
    "assign_message_id",
    "differences",
    "fab_bytes",
    "fast_path",
    "forget",
    "half_uploaded",
    "installed",
    "installed_fab",
    "mismatch",
    "node_infos",
    "online_node_ids",
    "oversized",
    "pace_supernode",
    "publishable_files",
    "pull_replies",
    "quick_object_pulls",
    "run_clientapp",
    "run_serverapp",
    "runtime_client",
    "server_identity",
    "skip_installed_fabs",
    "stock_command",
    "supernode_main",
    "unusable",
    "verify",
]
