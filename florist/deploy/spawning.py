"""Starting Flower's processes: the environment they run in, their commands, free ports, and a
handle on each process (its log, whether it is alive, stopping it by PID)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from florist.common.storage import open_log


def flower_env(flwr_home: Path | None = None) -> dict[str, str]:
    """Environment for every Flower process: FLWR_HOME (when given), no telemetry, no run-time
    dependency installation (it would `uv sync` gigabytes per run)."""
    # Flower starts `flower-superexec`, `flwr-serverapp` and `flwr-clientapp` by name: put this
    # environment's scripts first on PATH, so it works without an activated virtualenv.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return (
        os.environ
        | ({"FLWR_HOME": str(flwr_home)} if flwr_home else {})
        | {"PATH": path}
        | {
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        }
    )


def colours_for_terminals_only() -> None:
    """Flower colours its log lines whatever they go to: a process of the federation whose
    stderr is a file (its log) writes them plain."""
    if not sys.stderr.isatty():
        from flwr.common.logger import update_console_handler

        update_console_handler(colored=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def supernode_command(executor: str, preload: str | None = None, fork_server: Path | None = None) -> list[str]:
    """`florist supernode --executor EXECUTOR [--preload APP] [--fork-server SOCKET]`, run by
    this Python (no activated venv needed); `flower-supernode`'s options follow."""
    command = [sys.executable, "-m", "florist", "supernode", "--executor", executor]
    return (
        command
        + (["--preload", preload] if preload else [])
        + (["--fork-server", str(fork_server)] if fork_server else [])
    )


def superlink_command(max_message_bytes: int) -> list[str]:
    """`florist superlink --max-message-mb MB` (its HTTP APIs for this user only, its gRPC
    messages limited), run by this Python; `flower-superlink`'s options follow."""
    return [sys.executable, "-m", "florist", "superlink", "--max-message-mb", f"{max_message_bytes / 2**20:.6g}"]


def flower_bin(name: str) -> str:
    """A Flower executable from this Python's environment (works without an activated venv)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


# Beside its own keys, in the node config of every SuperNode that florist starts for its user on
# this machine (`federation.LocalFederation`: deploy-local, local-federation): its server is the
# user's own, whose folders it reads and whose requests it takes without caps (client/guard.py).
# Never in the node config of a box that joins a federation (`join.py`).
LOCAL_NODE_CONFIG = {"trusted-server": True}


def toml_node_config(values: dict[str, Any]) -> str:
    """`--node-config` / `--run-config` text: space-separated TOML `key=value` pairs (JSON
    spells strings, numbers and booleans as TOML does, except inf and nan)."""
    return " ".join(f"{k}={_toml_value(v)}" for k, v in values.items())


def _toml_value(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf", "-inf", "nan": TOML's spelling, not JSON's "Infinity"
    return json.dumps(value)


@dataclasses.dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; then whatever it left in its own
        process group (its SuperExec and ClientApp children), and nothing else."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        try:
            os.killpg(self.pid, signal.SIGTERM)  # the group was created for this process at spawn
        except ProcessLookupError:
            pass

    def tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def spawn(args: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> Process:
    """Start `args` in its own session (so Ctrl-C reaches us first and `stop` can clean up its
    process group), output appended to `log_path`."""
    with open_log(log_path, append=True) as handle:
        popen = subprocess.Popen(
            args, stdout=handle, stderr=subprocess.STDOUT, env=env or flower_env(), cwd=cwd, start_new_session=True
        )
    return Process(log_path.stem, popen, log_path)
