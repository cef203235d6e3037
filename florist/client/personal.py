"""The model a node earned: exactly what it scored with in its final evaluation of a run, kept
in its state folder as `models/<run id>/`, so that runs never overwrite each other's and
`florist predict` / `florist export` use the very weights (and, for kNN-Per, the very
datastore) the run's accuracy was measured with. The run id is Flower's own (the message's
metadata), not one a server writes in its config, and a node keeps its last `keep-models`
runs' models, removing older ones: a server cannot fill the node's disk with folders.

A kept model is a folder: `model.npz` (the network's state dict), `extras.npz` (what else the
strategy predicts with: kNN-Per's datastore) and `manifest.json`, written last, so a folder
with a manifest is whole. The manifest says what the model is (strategy, architecture, input
shape, classes and their names), where it came from (run id, round, node key, the data's fingerprint, the run
config) and how it scored (`accuracy` on the node's test split, None without test labels).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from florist.client.state import NodeState, default_root
from florist.common import classnames
from florist.common import data as data_lib
from florist.common.models import Net, build_model
from florist.common.storage import atomic_write

if TYPE_CHECKING:
    from florist.client.node import Node

log = logging.getLogger("flwr").getChild(__name__)
MODELS = "models"
MANIFEST, WEIGHTS, EXTRAS = "manifest.json", "model.npz", "extras.npz"
FORMAT = 1


@dataclasses.dataclass(frozen=True)
class Kept:
    """One kept model: its folder and manifest."""

    folder: Path
    manifest: dict[str, Any]

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.manifest["input_shape"])

    @property
    def num_classes(self) -> int:
        return int(self.manifest["num_classes"])

    @property
    def class_names(self) -> list[str]:
        """Each class's name (a folder's class folder, a digit), its number where the data named
        none or the model was kept before names were."""
        return classnames.numbered(self.manifest.get("class_names"), self.num_classes)

    def network(self) -> Net:
        """The network with its kept weights, in eval mode."""
        model = build_model(self.manifest["model"], self.input_shape, self.num_classes)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in self._arrays(WEIGHTS).items()})
        return model.eval()

    def extras(self) -> dict[str, np.ndarray]:
        return self._arrays(EXTRAS) if (self.folder / EXTRAS).exists() else {}

    def _arrays(self, name: str) -> dict[str, np.ndarray]:
        try:
            with np.load(self.folder / name, allow_pickle=False) as archive:
                return {k: archive[k] for k in archive.files}
        except (OSError, ValueError) as err:
            raise ValueError(f"{self.folder / name}: unreadable ({err})") from None

    @classmethod
    def read(cls, folder: Path) -> Kept:
        """The model kept in `folder` (one line naming the folder if it is not one)."""
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{folder}: no {MANIFEST}, so no kept model (or not a whole one)") from None
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{folder / MANIFEST}: unreadable ({err})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise ValueError(f"{folder / MANIFEST}: not a florist model manifest of format {FORMAT}")
        return cls(folder, manifest)


def keep(
    node: Node,
    model: Net,
    probs: np.ndarray | None,
    extras: dict[str, np.ndarray] | None = None,
    **details: Any,
) -> Path | None:
    """Keep `model` as the model `node` earned in this run (replacing the one an earlier
    evaluation of the run kept), with `probs`, its test-split probabilities, for the accuracy it
    scored; `extras` and `details` (JSON) are what the strategy predicts with besides. Kept by
    the final evaluation and the serve phase's (`Node.final_evaluation`), not at every
    `eval-every`: a thousand clients do not write (and fingerprint their data) every round, nor
    twice at the end when `eval-every` divides the rounds. Nothing is kept with
    `keep-models = 0`."""
    if not node.cfg.keep_models or not node.final_evaluation:
        return None
    d = node.data
    accuracy = None if probs is None or d.y_test is None else float((probs.argmax(1) == d.y_test).mean())
    manifest = {
        "format": FORMAT,
        "strategy": node.cfg.strategy,
        "run_id": node.flower_run_id,
        "round": node.server_round,
        "node_key": node.key,
        "seen": node.seen,
        "model": getattr(model, "architecture", node.cfg.model),
        "input_shape": list(d.input_shape),
        "num_classes": node.cfg.num_classes,
        "class_names": classnames.numbered(
            classnames.named(node.cfg.dataset, node.cfg.num_classes, node.node_config.get("data-dir")),
            node.cfg.num_classes,
        ),
        "accuracy": accuracy,
        "num_test": len(d.x_test),
        "data": {"train": data_lib.fingerprint(d.x_train), "test": data_lib.fingerprint(d.x_test)},
        "saved": time.time(),
        "versions": {"torch": torch.__version__},
        "run_config": node.cfg.to_mapping(),
        "node_config": node.node_config,
    } | details
    root = Path(node.cfg.models_root).expanduser() / node.key if node.cfg.models_root else node.state.folder
    folder = root / MODELS / str(node.flower_run_id)
    try:  # a copy for later: failing to write it must not fail the evaluation it comes from
        (folder / MANIFEST).unlink(missing_ok=True)  # the folder is not whole again until the new manifest lands
        weights = {k: v.cpu().numpy() for k, v in model.state_dict().items()}
        atomic_write(folder / WEIGHTS, lambda f: np.savez(f, **weights))
        if extras:
            atomic_write(folder / EXTRAS, lambda f: np.savez(f, **extras))
        else:
            (folder / EXTRAS).unlink(missing_ok=True)
        write_manifest(folder, manifest)
        prune(root / MODELS, node.cfg.keep_models, node.key)
        return folder / MANIFEST
    except OSError as err:
        log.warning("node %s: its model of run %s is not kept (%s)", node.key, node.flower_run_id, err)
        return None


def prune(models: Path, count: int, node_key: str) -> None:
    """Remove all but the `count` most recently written run folders under `models`, said in
    the node's log (a folder without its manifest, one cut short, counts by its own time)."""

    def written(folder: Path) -> float:
        return max(folder.stat().st_mtime, (folder / MANIFEST).stat().st_mtime if (folder / MANIFEST).exists() else 0)

    runs = sorted((f for f in models.iterdir() if f.is_dir()), key=written, reverse=True)
    for old in runs[count:]:
        shutil.rmtree(old, ignore_errors=True)
        log.info("node %s: removed its kept model of run %s (keep-models %d)", node_key, old.name, count)


def write_manifest(folder: Path, manifest: dict[str, Any]) -> Path:
    """`manifest.json`, replaced whole (its last write: it marks the folder whole)."""
    return atomic_write(folder / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=2, default=str).encode()))


def footprint(folder: Path) -> str:
    """What a node's state folder takes on its disk, for its operator: the total, and the runs
    it keeps models of (at most `keep-models`)."""
    files = [f for f in folder.rglob("*") if f.is_file()] if folder.is_dir() else []
    runs = [f for f in (folder / MODELS).iterdir() if f.is_dir()] if (folder / MODELS).is_dir() else []
    return f"{sum(f.stat().st_size for f in files) / 1e6:.1f} MB, the models of {len(runs)} runs"


def nodes_keeping_models(root: str | Path | None) -> tuple[Path, list[str]]:
    """The state folder and the keys of the nodes in it that keep models."""
    where = Path(root or default_root()).expanduser()
    return where, sorted(p.name for p in where.iterdir() if (p / MODELS).is_dir()) if where.is_dir() else []


def locate(root: str | Path | None, node_key: str | None, run_id: int | None, model_dir: str | None) -> Kept:
    """The kept model that `florist predict`'s and `export`'s flags name: `model_dir`'s, else node
    `node_key`'s of run `run_id` (default: its latest); without `node_key`, the one node under
    the state folder that keeps models. A node that keeps none is told with the nodes that do."""
    if model_dir is not None:
        return Kept.read(Path(model_dir).expanduser())
    where, keys = nodes_keeping_models(root)
    if node_key is None:
        if len(keys) != 1:
            said = f"nodes {', '.join(keys)} keep models there" if keys else "no node keeps a model there"
            raise FileNotFoundError(f"{where}: {said}; --node-key names the node (or --model a model folder)")
        node_key = keys[0]
    NodeState(root, node_key)  # a malformed key is one line, before any path is built from it
    if keys and node_key not in keys:
        raise FileNotFoundError(f"node {node_key} keeps no model in {where}; nodes that do: {', '.join(keys)}")
    return find(root, node_key, run_id)


def kept_models(root: str | Path | None, node_key: str) -> list[Kept]:
    """Every whole model node `node_key` keeps under state root `root`, oldest first."""
    folder = NodeState(root, node_key).folder / MODELS
    found = []
    for run in sorted(folder.iterdir()) if folder.is_dir() else ():
        try:
            found.append(Kept.read(run))
        except (FileNotFoundError, ValueError):
            continue  # being written, or not ours: `find` names the folder when asked for it
    return sorted(found, key=lambda k: k.manifest["saved"])


def find(root: str | Path | None, node_key: str, run_id: int | None = None) -> Kept:
    """The model node `node_key` kept in run `run_id` (default: its latest), or a
    FileNotFoundError naming the state folder and the runs it does hold."""
    kept = kept_models(root, node_key)
    where = NodeState(root, node_key).folder / MODELS
    if run_id is not None:
        if (where / str(run_id)).is_dir():
            return Kept.read(where / str(run_id))
        runs = ", ".join(str(k.manifest["run_id"]) for k in kept) or "none"
        raise FileNotFoundError(f"node {node_key} kept no model of run {run_id} in {where} (runs kept: {runs})")
    if not kept:
        root_said = "" if root else f" (the default state folder, {default_root()}; --state-dir names another)"
        raise FileNotFoundError(
            f"node {node_key} keeps no model in {where}{root_said}: a run's final evaluation keeps one"
        )
    return kept[-1]
