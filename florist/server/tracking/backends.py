"""One class per tracker, each a run of that tracker: open (or continue) it, log a round's
figures at step = round, log the end of the run, close it. Each imports its library when a run
names it (the tracking extra), and writes offline, under the run's tracking folder, unless its
user's own setting says where (MLFLOW_TRACKING_URI, a W&B login or WANDB_MODE)."""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from florist.server.tracking import Place


class Backend:
    """A tracker run. `continued`: it is the tracker run of the run's first part (from
    `before`, that part's entry in tracking.json); `logged`: the last round it has."""

    def __init__(self, place: Place, before: dict[str, Any]):
        place.root.mkdir(parents=True, exist_ok=True)
        self.continued, self.logged = False, 0

    def resume(self, continued: bool, before: dict[str, Any]) -> None:
        logged = before.get("logged", 0)
        self.continued = continued and type(logged) is int
        self.logged = logged if self.continued else 0

    def saved(self) -> dict[str, Any]:
        """What tracking.json keeps to find this tracker run again."""
        raise NotImplementedError

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def finish(self, step: int, summary: dict[str, float], results: dict[str, Any], folder: Path) -> None:
        """The summary, the per-client accuracies, the config and the report's files."""
        raise NotImplementedError

    def close(self, failed: bool) -> None:
        raise NotImplementedError


class TensorBoard(Backend):
    """Event files in TRACKING/tensorboard/<run> (a comparison's runs in subfolders), read by
    `tensorboard --logdir`. The config goes to the HParams tab, the report to Text, plots to Images."""

    def __init__(self, place: Place, before: dict[str, Any]):
        super().__init__(place, before)
        from torch.utils.tensorboard import SummaryWriter

        self.logdir, self.config = place.root / "tensorboard" / place.subdir, place.config
        self.resume(before.get("logdir") == str(self.logdir), before)
        # TensorBoard hides what was written before at or after `purge_step`: what a crash left
        # beyond the rounds this run's tracking.json counts, or an earlier run's in this folder.
        self.writer = SummaryWriter(str(self.logdir), purge_step=self.logged + 1)

    def saved(self) -> dict[str, Any]:
        return {"logdir": str(self.logdir)}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self, step: int, summary: dict[str, float], results: dict[str, Any], folder: Path) -> None:
        import numpy as np
        from PIL import Image
        from torch.utils.tensorboard.summary import hparams

        for group, values in accuracies(results).items():
            self.writer.add_histogram(f"clients/{group}_accuracy", np.array(values), step)
        columns, rows = client_table(results)
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        self.writer.add_text("clients", "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows]), step)
        self.writer.add_text("report", (folder / "report.md").read_text(), step)
        for path in sorted(folder.glob("*.png")):
            image = np.asarray(Image.open(path).convert("RGB"))
            self.writer.add_image(f"plots/{path.stem}", image, step, dataformats="HWC")
        for proto in hparams(self.config, summary):
            self.writer.file_writer.add_summary(proto, step)
        self.log(step, summary)

    def close(self, failed: bool) -> None:
        self.writer.close()


class Mlflow(Backend):
    """A run in MLflow's store: TRACKING/mlflow.db (MLflow's own default, a SQLite file; its
    older file store is in maintenance mode) with artifacts in TRACKING/mlartifacts, or
    MLFLOW_TRACKING_URI. One experiment per comparison (its folder's name), else `florist`
    (MLFLOW_EXPERIMENT_NAME wins); the config as params, the report's files as artifacts."""

    def __init__(self, place: Place, before: dict[str, Any]):
        super().__init__(place, before)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        for noisy in ("mlflow", "alembic"):  # a new store's table creation, each migration
            logging.getLogger(noisy).setLevel(logging.WARNING)
        self.local = not os.environ.get("MLFLOW_TRACKING_URI")
        self.uri = f"sqlite:///{place.root / 'mlflow.db'}" if self.local else os.environ["MLFLOW_TRACKING_URI"]
        self.client, self.run_id, self.done = MlflowClient(self.uri), before.get("run_id"), False
        self.resume(before.get("uri") == self.uri and isinstance(self.run_id, str) and self._exists(), before)
        if self.continued:
            # The store knows best what it got: a crash may have come after a round was logged
            # and before tracking.json said so.
            self.logged = max([self.logged, *(m.step for m in self.client.get_metric_history(self.run_id, "seconds"))])
            self.client.update_run(self.run_id, status="RUNNING")
            return
        tags = {"florist.strategy": str(place.config["strategy"]), "florist.seed": str(place.config["seed"])}
        tags |= {"florist.group": place.group} if place.group else {}
        self.run_id = self.client.create_run(self._experiment(place), run_name=place.name, tags=tags).info.run_id
        params = [Param(key, str(value)) for key, value in place.config.items()]
        for start in range(0, len(params), 100):  # MLflow takes up to 100 params in one batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def _exists(self) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(self.run_id).info.lifecycle_stage == "active"
        except MlflowException:
            return False

    def _experiment(self, place: Place) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or place.group or "florist"
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        artifacts = (place.root / "mlartifacts").as_uri() if self.local else None
        return self.client.create_experiment(name, artifact_location=artifacts)

    def saved(self) -> dict[str, Any]:
        return {"uri": self.uri, "run_id": self.run_id}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def finish(self, step: int, summary: dict[str, float], results: dict[str, Any], folder: Path) -> None:
        import tempfile

        self.log(step, summary)
        columns, rows = client_table(results)
        with tempfile.TemporaryDirectory() as scratch:
            table = Path(scratch) / "clients.csv"
            with table.open("w", newline="") as out:
                csv.writer(out).writerows([columns, *rows])
            self.client.log_artifact(self.run_id, str(table))
        for path in report_files(folder):
            self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, "FINISHED")
        self.done = True

    def close(self, failed: bool) -> None:
        if not self.done:
            self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class Wandb(Backend):
    """A Weights & Biases run in TRACKING/wandb: offline (`wandb sync` uploads it) unless the
    user is logged in or WANDB_MODE says otherwise. A resumed run writes a second offline part
    under the same run id (`wandb sync --id ID` appends both). Grouped by comparison; the config
    as the run's config, per-client accuracies as a table and histograms, plots as images."""

    def __init__(self, place: Place, before: dict[str, Any]):
        super().__init__(place, before)
        import wandb

        self.wandb, self.dir = wandb, str(place.root)
        self.resume(before.get("dir") == self.dir and isinstance(before.get("id"), str), before)
        # wandb itself refuses to start without a login; florist goes offline instead, quietly.
        offline = not os.environ.get("WANDB_MODE") and not wandb.login(prompt=False, verify=False)
        quiet = {"silent": True, "console": "off", "x_disable_stats": True, "disable_git": True, "save_code": False}
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "florist",
            dir=self.dir,
            id=before["id"] if self.continued else None,
            resume="allow" if self.continued else None,
            name=place.name,
            group=place.group,
            config=place.config,
            mode="offline" if offline else None,
            settings=wandb.Settings(**quiet, disable_job_creation=True),
            reinit="create_new",  # beside any run of the user's own in this process
        )
        self.done = False
        if self.continued and self.run.offline:
            self.logged = self._written(self.logged)

    def _written(self, logged: int) -> int:
        """The last round the earlier offline parts of this W&B run hold, as W&B reads them:
        it writes its file every 15 s, and a server that died took what it had not written
        yet with it. `logged` (tracking.json's) where W&B's reader cannot say."""
        steps, this_part = [0], Path(self.run.dir).parent
        for part in Path(self.dir, "wandb").glob(f"offline-run-*-{self.run.id}/run-{self.run.id}.wandb"):
            if part.parent == this_part:
                continue
            read = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(part)]
            done = subprocess.run(read, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                return logged
            records = [json.loads(line) for line in done.stdout.splitlines() if '"history"' in line]
            steps += [r["history"]["item"]["_step"] for r in records if r.get("type") == "history"]
        return max(steps)

    def saved(self) -> dict[str, Any]:
        return {"dir": self.dir, "id": self.run.id}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def finish(self, step: int, summary: dict[str, float], results: dict[str, Any], folder: Path) -> None:
        columns, rows = client_table(results)
        figures: dict[str, Any] = {"clients": self.wandb.Table(columns=columns, data=rows)}
        figures |= {f"clients/{g}_accuracy": self.wandb.Histogram(v) for g, v in accuracies(results).items()}
        figures |= {f"plots/{p.stem}": self.wandb.Image(str(p)) for p in sorted(folder.glob("*.png"))}
        self.run.log(figures, step=step)
        self.run.summary.update(summary)
        artifact = self.wandb.Artifact(f"florist-{self.run.id}", type="florist-run")
        for path in report_files(folder):
            artifact.add_file(str(path))
        self.run.log_artifact(artifact)
        self.run.finish()
        self.done = True

    def close(self, failed: bool) -> None:
        if not self.done:
            self.run.finish(exit_code=1 if failed else 0)


BACKENDS: dict[str, type[Backend]] = {"tensorboard": TensorBoard, "mlflow": Mlflow, "wandb": Wandb}


def accuracies(results: dict[str, Any]) -> dict[str, list[float]]:
    """Each group's (seen, unseen) client accuracies; a group without one is left out."""
    groups = {
        group: [c["accuracy"] for c in results["clients"] if c["seen"] == seen and c["accuracy"] is not None]
        for group, seen in (("seen", True), ("unseen", False))
    }
    return {group: values for group, values in groups.items() if values}


def client_table(results: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """results.json's per-client rows as columns (every field any client has) and rows."""
    columns = list(dict.fromkeys(k for c in results["clients"] for k in c))
    return columns, [[c.get(k) for k in columns] for c in results["clients"]]


def report_files(folder: Path) -> list[Path]:
    """What a finished run wrote beside its checkpoint: results.json, report.md and the plots."""
    return [folder / "results.json", folder / "report.md", *sorted(folder.glob("*.png"))]
