"""What the warm executor and the local federation use of Flower 1.39's runtime, beyond its CLI:

- the warm executor drives the Runtime API's task loop and Flower's ClientApp and ServerApp
  runtimes itself (`runtime_client`, `acquire_task`, `stock_command`, `run_clientapp`,
  `run_serverapp`, as `flower-superexec`, `flwr-clientapp` and `flwr-serverapp` call them);
- it signs its task requests with the SuperExec auth secret, as `flower-superexec
  --superexec-auth-secret-file` does (`runtime_client`, `load_auth_secret`);
- it finds the folder a SuperNode's ClientApps installed an app bundle in (`installed_fab`: Flower
  names it by the bundle hash's first 8 hex digits, so the caller checks what it holds), and a
  ClientApp process unpacks and re-verifies its app bundle for every message, even when that
  bundle is installed already (`flwr/cli/install.py`): `skip_installed_fabs` skips that for a
  folder its caller has checked;
- Flower puts an app's folder first on `sys.path` when it loads the app, so that any top-level
  module of the bundle shadows an installed one: `keep_app_folders_off_sys_path` stops that in a
  process that runs only preloaded code;
- `node_infos` (and `online_node_ids`) ask the Control API what `flwr supernode list` asks,
  without the CLI, keeping the public keys and names its output leaves out (`florist nodes`);
- `publishable_files` and `fab_bytes` find the files `flwr run` bundles without walking the
  folders .gitignore excludes.

The executor is started only on the fast path (`florist supernode`, `LocalFederation`), and
`skip_installed_fabs` does nothing off it; the callers of the others fall back to Flower's CLI.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from florist.common import flower_internals

# The Runtime API calls of the executor's own loop; with a SuperExec auth secret they are signed
# (Flower's SuperExec signs these and PullPendingTasks/ClaimTask, which the executor never calls).
SIGNED_CALLS = ("/flwr.proto.Runtime/AcquireTask",)


def load_auth_secret(path: str | None) -> bytes | None:
    """The SuperExec auth secret in `path` (its exact bytes, as `flower-superexec
    --superexec-auth-secret-file` reads it); ValueError naming the file if it is unreadable or empty."""
    from flwr.supercore.auth import load_superexec_auth_secret

    return load_superexec_auth_secret(path)


def runtime_client(address: str, root_certificates: str | None, auth_secret: bytes | None = None):
    """A client of a SuperNode's Runtime API, as Flower's SuperExec makes it (no retries:
    the executor's own loop decides what to do when the SuperNode is gone). With `auth_secret`
    its task requests carry the HMAC headers a SuperNode (SuperLink) started with the same
    `--superexec-auth-secret-file` requires."""
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor, SuperExecAuthHttpInterceptor
    from flwr.supercore.runtime import RuntimeHttpClient

    interceptors: list[Any] = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
    if auth_secret:
        interceptors.append(SuperExecAuthHttpInterceptor(master_secret=auth_secret, protected_methods=SIGNED_CALLS))
    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=root_certificates is None,
        root_certificates=root_certificates,
        interceptors=interceptors,
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
    """The folder where this machine's ClientApps installed the app bundle `fab_hash`, if there is
    one: `$FLWR_HOME/apps/<publisher>.<name>.<version>.<hash prefix>`. Flower names it by the
    hash's first 8 hex digits only (and installs nothing where one exists), so it may hold
    another bundle: what it holds is for the caller to check."""
    from flwr.common.constant import APP_DIR, FAB_HASH_TRUNCATION
    from flwr.supercore.utils import get_flwr_home

    found = sorted((get_flwr_home() / APP_DIR).glob(f"*.{fab_hash[:FAB_HASH_TRUNCATION]}"))
    return found[0] if fab_hash and found else None


def skip_installed_fabs(holds: Callable[[str, Path], bool] | None = None) -> bool:
    """In this process, Flower's ClientApp runtime installs an app bundle only when it is not
    installed already (it would unpack and hash every file again for every message): a folder
    counts as installed when `holds(full hash, folder)` says it holds exactly that bundle. A
    bundle it installs must then pass `holds` too, or the task fails (Flower keeps a folder that
    another bundle with the same 8-digit hash prefix installed). False (nothing changed) off the
    fast path, or without `holds`."""
    if holds is None or not flower_internals.fast_path():
        return False
    import hashlib

    from flwr.supernode.runtime import run_clientapp as runtime

    install = runtime.install_from_fab

    def install_once(fab_file: bytes, skip_prompt: bool = False) -> Path:
        fab_hash = hashlib.sha256(fab_file).hexdigest()
        if (folder := installed_fab(fab_hash)) is not None and holds(fab_hash, folder):
            return folder
        folder = install(fab_file, skip_prompt=skip_prompt)
        if not holds(fab_hash, folder):
            raise RuntimeError(f"app bundle {fab_hash}: {folder} does not hold exactly this bundle")
        return folder

    runtime.install_from_fab = install_once
    return True


def keep_app_folders_off_sys_path() -> bool:
    """In this process, loading a ClientApp or ServerApp no longer puts its app folder first on
    `sys.path` (`flwr.supercore.object_ref.load_app`): for a process whose app is imported
    already, nothing in a bundle can then shadow a module it imports later (a bundle's
    `torchvision/` would otherwise replace torchvision at its first import). False if this Flower
    loads apps otherwise (then the caller must not run bundles in this process)."""
    import inspect

    from flwr.supercore import object_ref

    if not callable(getattr(object_ref, "_ensure_sys_path", None)) or "_ensure_sys_path(project_dir)" not in (
        inspect.getsource(object_ref.load_app)
    ):
        return False
    object_ref._ensure_sys_path = lambda directory: None
    return True


def node_infos(address: str, root_certificates: str | None) -> list[Any]:
    """Every SuperNode the SuperLink at `address` (its Control API) knows, as Flower's NodeInfo
    (node_id, status, name, public_key, last_deactivated_at, ...): what `flwr supernode list`
    asks, without starting the CLI (2-3 CPU-seconds per call), and with the public keys and
    names its output leaves out. Raises httpx.HTTPError or ValueError when nobody answers."""
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
        return list(client.ListNodes(ListNodesRequest()).nodes_info)
    finally:
        client.close()


def online_node_ids(address: str, root_certificates: str | None) -> list[int]:
    """The SuperNodes the SuperLink at `address` lists as online."""
    return sorted(n.node_id for n in node_infos(address, root_certificates) if n.status == "online")


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
