"""A node's own folder for what must outlive a run (local models, FAISS datastores, chosen λ).

It is keyed by a stable node key from `--node-config`, never by Flower's node id, which
changes whenever a SuperNode restarts without an auth key.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from florist.common.storage import atomic_write, cache_dir


def default_root() -> Path:
    """`$XDG_CACHE_HOME/florist/nodes` (usually `~/.cache/florist/nodes`)."""
    return cache_dir() / "nodes"


class NodeState:
    """Files under `root/node_key/`, written atomically so a crash never leaves half a file."""

    def __init__(self, root: str | Path | None, node_key: str):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", node_key):
            raise ValueError(
                f"node key {node_key!r} must be 1-128 characters of letters, digits, '.', '_' or '-'"
            )
        self.key = node_key
        self.folder = Path(root or default_root()).expanduser() / node_key

    def path(self, name: str) -> Path:
        return self.folder / name

    def save_arrays(self, name: str, arrays: dict[str, np.ndarray]) -> Path:
        return atomic_write(self.path(name), lambda f: np.savez(f, **arrays))

    def load_arrays(self, name: str) -> dict[str, np.ndarray] | None:
        """The arrays saved under `name`, or None if there are none yet."""
        path = self.path(name)
        if not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as archive:
                return {k: archive[k] for k in archive.files}
        except (ValueError, OSError) as err:
            raise ValueError(f"node state file {path} is unreadable ({err}); delete it to rebuild") from err

    def save_json(self, name: str, value: Any) -> Path:
        return atomic_write(self.path(name), lambda f: f.write(json.dumps(value, indent=2).encode()))

    def load_json(self, name: str) -> Any | None:
        path = self.path(name)
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"node state file {path} is not valid JSON ({err}); delete it to rebuild") from err
