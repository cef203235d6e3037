"""What a node keeps, in one API and under one naming rule, `<algorithm>/<name>`:

- `remember` / `recall`: for the current run only, in Flower's `context.state` (the SuperNode
  keeps it between the messages of a run, whichever process answers them);
- `save_*` / `load_*`: files in the node's own folder, which outlive runs and restarts (local
  models, FAISS datastores). The folder is keyed by a stable node key from `--node-config`,
  never by Flower's node id, which changes whenever a SuperNode restarts without an auth key;
- `save_round` / `load_round`: such files, versioned by run and round, for what a node carries
  from round to round of a run (its own model): a run resumed from the server's checkpoint
  finds the node's state as of that round, never a later one.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from florist.common.storage import atomic_write, cache_dir

META = "__meta__"  # the JSON `meta` of a `save_round` version, stored beside its arrays
OTHER_RUNS = 2  # runs besides the current one whose round state a node keeps (to resume them)
ACTIVE_SECONDS = 3600.0  # ... besides those that saved this recently: they may be running now, beside this one


def default_root() -> Path:
    """`$XDG_CACHE_HOME/florist/nodes` (usually `~/.cache/florist/nodes`)."""
    return cache_dir() / "nodes"


class NodeState:
    """A node's state for one algorithm (`namespace`); files are written atomically, so a
    crash never leaves half a file."""

    def __init__(self, root: str | Path | None, node_key: str, namespace: str = "", memory: RecordDict | None = None):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", node_key):
            raise ValueError(f"node key {node_key!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")
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

    def save_round(
        self, name: str, arrays: Mapping[str, np.ndarray], run_id: int, server_round: int, **meta: Any
    ) -> None:
        """Keep `arrays` (and small JSON `meta`) as `name` after `server_round` of run `run_id`.
        Of this run's other versions only the newest before this round stays: a server that
        dies before it checkpoints this round resumes from that one; later rounds' (a resumed
        run's abandoned future) go. Of other runs, the last `OTHER_RUNS` stay, resumable too, and so
        does every run that saved within `ACTIVE_SECONDS`: runs sharing the node's folder at the
        same time (a compare beside a simulate) must not delete each other's models."""
        self.save_arrays(f"{name}-{run_id}-{server_round}.npz", {**arrays, META: np.array(json.dumps(meta))})
        versions = self._versions(name)
        older = [r for (run, r) in versions if run == run_id and r < server_round]
        keep = {(run_id, server_round)} | ({(run_id, max(older))} if older else set())
        saved = {run: max(path.stat().st_mtime for v, path in versions.items() if v[0] == run) for run, _ in versions}
        by_age = sorted(set(saved) - {run_id}, key=saved.get)
        active = {run for run in by_age if time.time() - saved[run] < ACTIVE_SECONDS}
        keep |= {v for v in versions if v[0] in set(by_age[len(by_age) - OTHER_RUNS :]) | active}
        for version in set(versions) - keep:
            versions[version].unlink(missing_ok=True)

    def load_round(self, name: str, run_id: int, up_to: int) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """(arrays, meta) of the newest version of `name` in run `run_id` from round `up_to` or
        before, or None."""
        rounds = [r for (run, r) in self._versions(name) if run == run_id and r <= up_to]
        if not rounds:
            return None
        arrays = self.load_arrays(f"{name}-{run_id}-{max(rounds)}.npz") or {}
        return arrays, json.loads(str(arrays.pop(META)))

    def _versions(self, name: str) -> dict[tuple[int, int], Path]:
        pattern = re.compile(rf"{re.escape(name)}-(\d+)-(\d+)\.npz")
        folder = self.path(name).parent
        found = (pattern.fullmatch(p.name) for p in folder.glob(f"{name}-*.npz")) if folder.is_dir() else ()
        return {(int(m[1]), int(m[2])): folder / m[0] for m in found if m}

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
