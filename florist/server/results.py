"""A run's results folder: `results.json`, `checkpoint.pt`, `report.md` and PNG plots.

`results.json` and the checkpoint are rewritten atomically after every round, so a run that
dies keeps everything up to its last finished round.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from florist.common import classnames, protocol
from florist.common.metrics import summarize
from florist.common.storage import atomic_write
from florist.config import RunConfig
from florist.server.checkpoint import Checkpoint
from florist.server.strategy import NodeInfo

STANDARD_CLIENT_KEYS = ("accuracy", "num-examples", "num-train", "seen")


class Results:
    def __init__(self, cfg: RunConfig, section: Callable[..., list[str]] | None = None, run_id: int = 0):
        """`section(results, folder)`: the strategy's own part of report.md. `run_id`: Flower's,
        which each node's kept model is named by (`florist predict --run-id`)."""
        self.cfg, self.section, self.run_id = cfg, section, run_id
        self.folder = Path(cfg.results_dir).expanduser()
        self.rounds: list[dict[str, Any]] = []
        self.clients: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.stopped = ""  # why training ended before num-server-rounds (a privacy budget), "" when it did not
        # central dp sampling a fraction: a private (Poisson) sample, whose rounds' failures name no node
        self.sample_withheld = cfg.user_dp == "central" and cfg.fraction_train < 1
        # the classes' names as the run's dataset gives them (None: it names none; a node reading its
        # own folder keeps its own names in its models' manifests)
        self.class_names = classnames.named(cfg.dataset, cfg.num_classes)
        self.data: list[dict[str, Any]] = []  # what the nodes said of their data (`data_groups`)

    def add_round(
        self,
        server_round: int,
        seconds: float,
        up: int,
        down: int,
        loss: float | None,
        accuracy: float | None,
        extras: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Record a round; `extras` are the strategy's own figures for it."""
        row = {
            "round": server_round,
            "seconds": round(seconds, 4),
            "bytes_up": up,
            "bytes_down": down,
            "train_loss": loss,
            "accuracy": accuracy,
        } | (extras or {})
        self.rounds.append(row)
        return row

    def set_clients(
        self,
        nodes: list[NodeInfo],
        metrics: dict[int, dict[str, float]],
        record: Mapping[int, Mapping[str, Any]] | None = None,
    ) -> None:
        """Per-client rows from the final evaluation; nodes that failed it, or could not be
        scored (no test labels), get accuracy None. `record` (record-level dp): what each node last
        said of its ε, which its row keeps as `dp_record_epsilon` (0 for a node that took no DP-SGD step)."""
        self.clients = []
        for node in nodes:
            values = metrics.get(node.node_id)
            row = {
                "client": node.key,
                "seen": node.seen,
                "num_train": node.num_train,
                "num_test": node.num_test,
                "accuracy": (values or {}).get("accuracy"),
            }
            extra = {k.replace("-", "_"): v for k, v in (values or {}).items() if k not in STANDARD_CLIENT_KEYS}
            if record is not None:
                said = record.get(node.node_id, {})
                extra["dp_record_epsilon"] = said.get("epsilon", None if "guarantee" in said else 0.0)
            if files := node.data.get(protocol.SKIPPED_FILES):
                extra["skipped_files"] = list(files)  # the first of them, as the node named them
            self.clients.append(row | extra)
        self.data = data_groups(self.cfg.dataset, nodes)
        names = {tuple(group["class_names"] or ()) for group in self.data}
        if len(names) == 1:  # what every node said, in place of what the run's dataset names
            self.class_names = list(names.pop()) or None
        elif names:
            self.class_names = None  # the nodes differ: each group of `data` names its own

    def summary(self) -> dict[str, dict[str, float | int]]:
        out = {}
        for group, seen in (("seen", True), ("unseen", False)):
            rows = [c for c in self.clients if c["seen"] == seen and c["accuracy"] is not None]
            out[group] = summarize([c["accuracy"] for c in rows], [c["num_test"] for c in rows])
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": self.cfg.strategy,
            "run_id": self.run_id,
            "config": self.cfg.to_mapping(),
            "complete": bool(self.clients),
            "rounds": self.rounds,
            "clients": self.clients,
            **({"class_names": self.class_names} if self.class_names else {}),
            **({"data": self.data} if self.data else {}),
            "summary": self.summary(),
            "round_accuracy": round_accuracy(self.rounds),
            "failures": withheld(self.failures, self.cfg.num_server_rounds) if self.sample_withheld else self.failures,
        } | ({"stopped": self.stopped} if self.stopped else {})

    def checkpoint(self, checkpoint: Checkpoint) -> None:
        """Save the checkpoint, then results.json (called after every round): a crash between
        the two leaves a checkpoint one round ahead, never behind."""
        self.failures = checkpoint.failures
        checkpoint.save(self.folder)
        self.save()

    def save(self) -> None:
        """results.json as it stands (`complete` once the clients are scored)."""
        atomic_write(self.folder / "results.json", lambda f: f.write(_dumps(self.to_json())))

    def write(self) -> None:
        """The final results.json, report.md and plots."""
        from florist.server.report import write_report

        self.save()
        write_report(self.to_json(), self.folder, self.section)


def data_groups(dataset: str, nodes: list[NodeInfo]) -> list[dict[str, Any]]:
    """The nodes grouped by what they said of their data at discovery (source, class names, input
    shape), largest group first: one group where all agree. A source that is the run's own
    `dataset` as a node names it is shown as the run config gives it (the path the user typed)."""
    groups: dict[tuple, dict[str, Any]] = {}
    ours = classnames.source_of(dataset)
    for node in nodes:
        if protocol.DATA_SOURCE not in node.data:  # a node of an earlier florist says nothing of it
            continue
        source = node.data[protocol.DATA_SOURCE]
        names = node.data.get(protocol.CLASS_NAMES)
        key = (source, tuple(names or ()), tuple(node.input_shape))
        group = groups.setdefault(
            key,
            {
                "source": dataset if source == ours else source,
                "class_names": names,
                "input_shape": list(node.input_shape),
                "clients": [],
            },
        )
        group["clients"].append(node.key)
    return sorted(groups.values(), key=lambda g: -len(g["clients"]))


def note_error(results_dir: str, error: str | None) -> None:
    """Write why a run stopped into its results.json (`error`), where a deployed run's driver
    (`florist deploy-local`, which sees only `flwr run`'s exit) finds it; None takes it out again
    (a run about to resume). Nothing when the run wrote no results.json, or complete ones (a
    resume of a finished run that fails leaves them as they were)."""
    path = Path(results_dir).expanduser() / "results.json"
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if results.get("complete"):
        return
    results.pop("error", None)
    atomic_write(path, lambda f: f.write(_dumps(results | ({"error": protocol.one_line(error)} if error else {}))))


WITHHELD = "a node of the round's private sample"


def withheld(failures: list[dict[str, Any]], rounds: int) -> list[dict[str, Any]]:
    """`failures` as results.json keeps them under a private sample: a training round's say what
    failed, not who (whose failure tells it was drawn); discovery's and the final evaluation's
    name the node. The server's log and checkpoint keep every name."""
    hide = lambda f: 1 <= f["round"] <= rounds  # noqa: E731
    return [{k: v for k, v in f.items() if k != "node_id"} | {"node": WITHHELD} if hide(f) else f for f in failures]


def round_accuracy(rounds: list[dict[str, Any]]) -> dict[str, float | int | None]:
    """The seen clients' mean accuracy at the best evaluated round (the papers' figure; the
    earliest on a tie) and at the last one (the final evaluation, in `summary`, is florist's)."""
    evaluated = [r for r in rounds if r["accuracy"] is not None and math.isfinite(r["accuracy"])]
    if not evaluated:
        return {"best": None, "best_round": None, "last": None, "last_round": None}
    best = max(evaluated, key=lambda r: r["accuracy"])
    return {
        "best": best["accuracy"],
        "best_round": best["round"],
        "last": evaluated[-1]["accuracy"],
        "last_round": evaluated[-1]["round"],
    }


def check_results_dir(path: str) -> Path:
    """The results folder, created and written to once; a ValueError saying why it cannot be."""
    folder = Path(path).expanduser().absolute()
    probe = folder / f".florist-write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # Created, never opened through a link someone planted there (O_EXCL refuses any existing name).
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        probe.unlink()
    except OSError as err:
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        why = (
            f"{existing} is a file, not a folder"
            if not existing.is_dir()
            else f"{existing} refuses it ({err.strerror})"
        )
        raise ValueError(f"results-dir {str(folder)!r} cannot be written: {why}") from None
    return folder


def jsonable(value: Any) -> Any:
    """`value` as results.json holds it: NaN and ±inf as null (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: jsonable(x) for k, x in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(x) for x in value]
    return value


def _dumps(value: Any) -> bytes:
    return json.dumps(jsonable(value), indent=2).encode()
