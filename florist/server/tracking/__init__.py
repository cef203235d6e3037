"""Experiment trackers: the ServerApp hands TensorBoard, MLflow and Weights & Biases every number
results.json has, round by round, so a run can be watched live and compared with others.

Only the server logs (a tracker costs the nodes nothing), and only rounds already checkpointed:
a tracker shows what a resumed run keeps. Which tracker run this run is, and how many rounds
each tracker got, is kept in `tracking.json` in the results folder, so a resumed run goes on in
the same tracker run, first with the checkpointed rounds a tracker missed, and logs nothing twice.
A tracker is a guest: one that fails is warned about once and dropped; results.json stays the record.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from florist.common.storage import atomic_write
from florist.config import RunConfig, parse_trackers

log = logging.getLogger("flwr").getChild(__name__)

STATE = "tracking.json"
EXTRA = "pip install -e '.[tracking]' in florist's checkout"


def check_installed(cfg: RunConfig) -> None:
    """Refuse, in one line naming the extra, a run that names a tracker this Python lacks."""
    for name in parse_trackers(cfg.trackers):
        if importlib.util.find_spec(name) is None:
            raise ValueError(f"tracker {name!r} needs the {name} package, which is not installed: {EXTRA}")


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a run's trackers write and what they call it: `root` holds their files (the results
    folder, or one shared by a comparison's runs), `subdir` is the run's own part of it, `name`
    the run's name, `group` the comparison's (None for a run alone)."""

    root: Path
    subdir: str
    name: str
    group: str | None
    config: dict[str, Any]

    @classmethod
    def of(cls, cfg: RunConfig) -> Place:
        results = Path(cfg.results_dir).expanduser().absolute()
        root = Path(cfg.tracking_dir).expanduser().absolute() if cfg.tracking_dir else results
        inside = results.is_relative_to(root)
        subdir = results.relative_to(root).as_posix() if inside else results.name
        subdir = "" if subdir == "." else subdir
        return cls(root, subdir, subdir or results.name, root.name if subdir else None, cfg.to_mapping())


class Tracking:
    """The trackers of one run. `with Tracking.start(cfg) as tracking:` around the rounds and
    the final evaluation; leaving it by an exception closes the tracker runs as failed."""

    def __init__(self, folder: Path, trackers: dict[str, Any], state: dict[str, dict[str, Any]]):
        self.folder, self.trackers, self.state = folder, trackers, state

    @classmethod
    def start(cls, cfg: RunConfig) -> Tracking:
        """Open the trackers `cfg` names: on a resumed run, the tracker runs of its first part
        (`tracking.json` of the folder it resumes from); on a new one, new tracker runs."""
        from florist.server.tracking.backends import BACKENDS

        folder = Path(cfg.results_dir).expanduser()
        saved = _load(Path(cfg.resume_from).expanduser() / STATE) if cfg.resume_from else {}
        tracking = cls(folder, {}, dict(saved))  # a tracker not named now keeps its entry for a later part
        place = Place.of(cfg) if cfg.trackers.strip() else None
        for name in parse_trackers(cfg.trackers):
            before = saved.get(name, {})
            try:
                tracker = BACKENDS[name](place, before)
            except Exception as err:  # a guest: a tracker that cannot start is left out
                _warn(name, "starting", err)
                continue
            tracking.trackers[name] = tracker
            finished = tracker.continued and before.get("finished") is True
            tracking.state[name] = tracker.saved() | {"logged": tracker.logged, "finished": finished}
        tracking._save()
        return tracking

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, kind, error, trace) -> None:
        for name, tracker in list(self.trackers.items()):
            self._guarded(name, "closing", tracker.close, kind is not None)
        self.trackers = {}

    def log_rounds(self, rounds: list[dict[str, Any]], failures: list[dict[str, Any]]) -> None:
        """Give each tracker the rows of `rounds` (checkpointed) it has not had yet."""
        for name, tracker in list(self.trackers.items()):
            for row in (r for r in rounds if r["round"] > self.state[name]["logged"]):
                if not self._guarded(
                    name, f"logging round {row['round']}", tracker.log, row["round"], flat(row, failures)
                ):
                    break
                self.state[name]["logged"] = tracker.logged = row["round"]
        self._save()

    def finish(self, results: dict[str, Any], folder: Path) -> None:
        """The rounds not logged yet, then the summary, per-client accuracies, config and the
        report's files, once per tracker run (a run resumed after its end logs them again nowhere)."""
        self.log_rounds(results["rounds"], results["failures"])
        step = results["rounds"][-1]["round"] if results["rounds"] else 0
        for name, tracker in list(self.trackers.items()):
            if not self.state[name]["finished"] and self._guarded(
                name, "logging the summary", tracker.finish, step, summary(results), results, folder
            ):
                self.state[name]["finished"] = True
        self._save()

    def _guarded(self, name: str, doing: str, call, *args) -> bool:
        """`call(*args)`; a tracker that raises is warned about, closed and dropped (False)."""
        try:
            call(*args)
            return True
        except Exception as err:
            _warn(name, doing, err)
            tracker = self.trackers.pop(name, None)
            if tracker is not None and doing != "closing":
                try:
                    tracker.close(True)
                except Exception as also:
                    log.debug("%s tracker: closing after a failure failed too: %s", name, also)
            return False

    def _save(self) -> None:
        if self.state:
            atomic_write(self.folder / STATE, lambda f: f.write(json.dumps(self.state, indent=1).encode()))


def flat(row: Mapping[str, Any], failures: list[dict[str, Any]]) -> dict[str, float]:
    """Every number of a results.json round row under its key; an exchange's under
    `exchanges/<type>/<key>` (`#2` on a type's second exchange in the round), a list's length
    under `<key>/count`, and the node failures in the round and up to it. A value results.json
    writes as null (none, NaN) is left out."""
    metrics, seen = {}, {}
    for key, value in row.items():
        if key == "exchanges":
            for exchange in value:
                kind = str(exchange["type"]).replace(".", "-")
                seen[kind] = seen.get(kind, 0) + 1
                prefix = f"exchanges/{kind}" + (f"#{seen[kind]}" if seen[kind] > 1 else "")
                metrics |= {f"{prefix}/{k}": float(v) for k, v in exchange.items() if _number(v)}
        elif key != "round" and _number(value):
            metrics[key] = float(value)
        elif isinstance(value, list):
            metrics[f"{key}/count"] = float(len(value))
    metrics["failures/round"] = float(sum(f["round"] == row["round"] for f in failures))
    metrics["failures/total"] = float(sum(f["round"] <= row["round"] for f in failures))
    return metrics


def summary(results: Mapping[str, Any]) -> dict[str, float]:
    """The run's closing figures: each group's summary, the best and last evaluated round's
    accuracy, and the failures, under `summary/`."""
    figures = {f"summary/{group}/{k}": v for group, values in results["summary"].items() for k, v in values.items()}
    figures |= {f"summary/round_accuracy/{k}": v for k, v in results["round_accuracy"].items()}
    figures["summary/failures"] = len(results["failures"])
    return {k: float(v) for k, v in figures.items() if _number(v)}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _warn(name: str, doing: str, err: Exception) -> None:
    log.warning(
        "tracker %s failed while %s (%s: %s); the run goes on without it (results.json has everything)",
        name,
        doing,
        type(err).__name__,
        str(err).splitlines()[0] if str(err) else "",
    )


def _load(path: Path) -> dict[str, dict[str, Any]]:
    """A results folder's tracking state; none where it is missing or unreadable (new tracker runs)."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in state.items() if isinstance(v, dict)} if isinstance(state, dict) else {}
