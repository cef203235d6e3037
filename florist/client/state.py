"""What a node keeps, in one API and under one naming rule, `<algorithm>/<name>`:

- `remember` / `recall`: for the current run only, in Flower's `context.state` (the SuperNode
  keeps it between the messages of a run, whichever process answers them);
- `save_*` / `load_*`: files in the node's own folder, which outlive runs and restarts (local
  models, FAISS datastores). The folder is keyed by a stable node key from `--node-config`,
  never by Flower's node id, which changes whenever a SuperNode restarts without an auth key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from florist.common.storage import atomic_write, cache_dir


def default_root() -> Path:
    """`$XDG_CACHE_HOME/florist/nodes` (usually `~/.cache/florist/nodes`)."""
    return cache_dir() / "nodes"


class NodeState:
    """A node's state for one algorithm (`namespace`); files are written atomically, so a
    crash never leaves half a file."""

    def __init__(self, root: str | Path | None, node_key: str, namespace: str = "", memory: RecordDict | None = None):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", node_key):
            raise ValueError(
                f"node key {node_key!r} must be 1-128 characters of letters, digits, '.', '_' or '-'"
            )
        self.key, self.namespace = node_key, namespace
        self.folder = Path(root or default_root()).expanduser() / node_key
        self.memory = RecordDict() if memory is None else memory

    def _name(self, name: str) -> str:
        return f"{self.namespace}/{name}" if self.namespace else name

    # --- for this run ------------------------------------------------------------------
    def remember(self, name: str, arrays: Mapping[str, torch.Tensor], **values: Any) -> None:
        """Keep `arrays` (and small `values`) until the run ends."""
        self.memory[self._name(name)] = ArrayRecord(dict(arrays))
        self.memory[self._name(name) + ".values"] = ConfigRecord(values)

    def recall(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """What `remember(name, ...)` kept in this run, or None."""
        if self._name(name) not in self.memory.array_records:
            return None
        arrays = self.memory.array_records[self._name(name)].to_torch_state_dict()
        return arrays, dict(self.memory.config_records.get(self._name(name) + ".values", {}))

    # --- in the node's folder ---------------------------------------------------------
    def path(self, name: str) -> Path:
        return self.folder / self._name(name)

    def save_arrays(self, name: str, arrays: Mapping[str, np.ndarray]) -> Path:
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
