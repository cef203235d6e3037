"""Experiment trackers, read back with their own readers (TensorBoard's EventAccumulator,
MLflow's client, W&B's `wandb leet inspect` of the offline run files): every round of an
interrupted-and-resumed run once, with results.json's values, in the same tracker run."""

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest

from florist.cli import main
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.server.checkpoint import resumed_config
from florist.server.tracking import Tracking, flat

NUM_CLIENTS = 3
ALL = "tensorboard,mlflow,wandb"
# The server process dies after round `argv[2]` is checkpointed and logged: no exit handler runs.
CRASH = f"""
import json, os, sys
import florist.apps.registry  # hands the run config its strategies, as every entry point does
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
die = lambda row: row["round"] == int(sys.argv[2]) and os._exit(3)
run_in_process(RunConfig.from_mapping(json.loads(sys.argv[1])), {NUM_CLIENTS}, on_round=die)
"""


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """W&B offline whatever this machine's login (florist's default without one)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _cfg(folder: Path, trackers: str, rounds: int = 4) -> dict:
    return {
        "strategy": "fedavg",
        "num-server-rounds": rounds,
        "min-nodes": NUM_CLIENTS,
        "unseen-fraction": 0.34,
        "eval-every": 2,
        "model": "mlp",
        "results-dir": str(folder),
        "trackers": trackers,
    }


class Stop(Exception):
    """Ctrl-C in the middle of a run."""


def _interrupt(values: dict, after: int) -> None:
    def stop(row):
        if row["round"] == after:
            raise Stop

    with pytest.raises(Stop):
        run_in_process(RunConfig.from_mapping(values), NUM_CLIENTS, on_round=stop)


def _expected(results: dict) -> dict[int, dict[str, float]]:
    """Per round, the figures results.json has for it, under the trackers' names."""
    rows = {}
    for row in results["rounds"]:
        figures = {k: row[k] for k in ("seconds", "bytes_up", "bytes_down", "train_loss", "accuracy")}
        for exchange in row["exchanges"]:
            figures |= {f"exchanges/{exchange['type']}/{k}": v for k, v in exchange.items() if k != "type"}
        figures |= {"failures/round": 0, "failures/total": 0}
        rows[row["round"]] = {k: float(v) for k, v in figures.items() if v is not None}
        assert set(rows[row["round"]]) == set(flat(row, results["failures"]))  # nothing else, nothing less
    return rows


def _tensorboard(logdir: Path) -> dict[int, dict[str, float]]:
    """What TensorBoard shows, by step, after checking that no event file holds a step twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    raw = [
        e.step
        for f in sorted(logdir.glob("events.*"))
        for e in LegacyEventFileLoader(str(f)).Load()
        if any(v.tag == "seconds" for v in e.summary.value)
    ]
    assert len(raw) == len(set(raw)), f"a round written twice: {sorted(raw)}"
    shown = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    shown.Reload()
    rows: dict[int, dict[str, float]] = {}
    for tag in shown.Tags()["scalars"]:
        for event in shown.Scalars(tag):
            rows.setdefault(event.step, {})[tag] = event.value
    return rows


def _mlflow(folder: Path, run_id: str) -> tuple[dict[int, dict[str, float]], object]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    run = client.get_run(run_id)
    rows: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        history = client.get_metric_history(run_id, key)
        assert len({m.step for m in history}) == len(history), f"{key} logged twice at a step"
        for metric in history:
            rows.setdefault(metric.step, {})[key] = metric.value
    return rows, (client, run)


def _wandb(folder: Path) -> tuple[set[str], list[dict]]:
    """The run ids and history rows of every offline part of the W&B run, read by wandb's CLI."""
    ids, rows = set(), []
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        command = [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(path)]
        for line in subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines():
            record = json.loads(line)
            if record["type"] == "run":
                ids.add(record["run"]["run_id"])
            elif record["type"] == "history":
                rows.append(record["history"]["item"])
    return ids, rows


def _same(logged: dict[int, dict[str, float]], expected: dict[int, dict[str, float]], rel: float = 0.0) -> None:
    """Every expected figure logged at its round, equal (within `rel`: TensorBoard keeps float32)."""
    for step, figures in expected.items():
        for key, value in figures.items():
            assert math.isclose(logged[step][key], value, rel_tol=rel, abs_tol=rel), (step, key)


def test_a_resumed_run_goes_on_in_the_same_tracker_runs_with_every_round_once(tmp_path):
    folder = tmp_path / "run"
    crashed = subprocess.run([sys.executable, "-c", CRASH, json.dumps(_cfg(folder, ALL)), "2"], capture_output=True)
    assert crashed.returncode == 3, crashed.stderr.decode()[-2000:]
    before = json.loads((folder / "tracking.json").read_text())
    assert {name: s["logged"] for name, s in before.items()} == {"tensorboard": 2, "mlflow": 2, "wandb": 2}

    results = run_in_process(resumed_config(folder, {}), NUM_CLIENTS)
    after = json.loads((folder / "tracking.json").read_text())
    assert after["mlflow"]["run_id"] == before["mlflow"]["run_id"] and after["wandb"]["id"] == before["wandb"]["id"]
    assert after["tensorboard"]["logdir"] == before["tensorboard"]["logdir"] == str(folder / "tensorboard")
    expected = _expected(results)
    assert sorted(expected) == [1, 2, 3, 4] and results["complete"]

    shown = _tensorboard(folder / "tensorboard")
    _same(shown, expected, rel=1e-6)
    assert math.isclose(
        shown[4]["summary/seen/mean_accuracy"], results["summary"]["seen"]["mean_accuracy"], rel_tol=1e-6
    )

    logged, (client, run) = _mlflow(folder, before["mlflow"]["run_id"])
    _same(logged, expected)
    assert logged[4]["summary/unseen/mean_accuracy"] == results["summary"]["unseen"]["mean_accuracy"]
    assert run.info.status == "FINISHED" and run.data.params["strategy"] == "fedavg"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"clients.csv", "report.md", "results.json", "client_accuracy.png"} <= artifacts

    ids, rows = _wandb(folder)
    assert ids == {before["wandb"]["id"]} and len(list(folder.glob("wandb/offline-run-*"))) == 2
    assert [r["_step"] for r in rows] == [1, 2, 3, 4]
    _same({r["_step"]: r for r in rows}, expected)


def test_a_tracker_added_on_resume_gets_the_checkpointed_rounds_first(tmp_path, caplog):
    """A run interrupted under TensorBoard alone, resumed with MLflow too: MLflow gets rounds
    1-2 from the checkpoint, then 3-4; TensorBoard goes on with round 3."""
    folder = tmp_path / "run"
    _interrupt(_cfg(folder, "tensorboard"), after=2)
    with caplog.at_level(logging.WARNING):
        results = run_in_process(resumed_config(folder, {"trackers": "tensorboard,mlflow"}), NUM_CLIENTS)
    assert "tracker" not in caplog.text
    expected = _expected(results)
    _same(_tensorboard(folder / "tensorboard"), expected, rel=1e-6)
    state = json.loads((folder / "tracking.json").read_text())
    logged, _ = _mlflow(folder, state["mlflow"]["run_id"])
    _same(logged, expected)
    assert sorted(logged) == [1, 2, 3, 4]


def test_a_compare_makes_one_tracker_run_per_strategy_and_seed_grouped(tmp_path):
    out = tmp_path / "cmp"
    argv = ["compare", "--runtime", "in-process", "--strategies", "fedavg,local", "--seeds", "1", "--out", str(out)]
    assert main([*argv, "--num-clients", str(NUM_CLIENTS), "--rounds", "2", "--track", ALL]) == 0
    for strategy in ("fedavg", "local"):
        assert _tensorboard(out / "tensorboard" / strategy / "seed1")[2]["seconds"] > 0
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("cmp").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["fedavg/seed1", "local/seed1"]
    assert {r.data.tags["florist.group"] for r in runs} == {"cmp"}
    parts = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
    command = [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json"]
    records = [
        json.loads(subprocess.run([*command, str(p)], capture_output=True, text=True).stdout.splitlines()[1])
        for p in parts
    ]
    assert sorted((r["run"]["display_name"], r["run"]["run_group"]) for r in records) == [
        ("fedavg/seed1", "cmp"),
        ("local/seed1", "cmp"),
    ]


def test_a_tracker_that_fails_mid_run_is_warned_about_once_and_dropped(tmp_path, caplog):
    """MLflow refuses a metric name with '?': it is dropped, TensorBoard goes on, the run too."""
    cfg = RunConfig.from_mapping(_cfg(tmp_path, "tensorboard,mlflow"))
    rows = [
        {"round": r, "seconds": 0.5 * r, "odd?figure" if r == 2 else "train_loss": 1.0, "exchanges": []}
        for r in (1, 2, 3)
    ]
    with caplog.at_level(logging.WARNING), Tracking.start(cfg) as tracking:
        for r in (1, 2, 3):
            tracking.log_rounds(rows[:r], [])
    assert caplog.text.count("tracker mlflow failed while logging round 2") == 1 and "tensorboard" not in caplog.text
    state = json.loads((tmp_path / "tracking.json").read_text())
    assert state["mlflow"]["logged"] == 1 and state["tensorboard"]["logged"] == 3
    assert sorted(_tensorboard(tmp_path / "tensorboard")) == [1, 2, 3]


def test_a_tracker_that_is_not_installed_is_refused_before_the_run_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the tracking extra were not installed
    argv = ["simulate", "--runtime", "in-process", "--num-clients", "3", "--results-dir", str(tmp_path)]
    assert main([*argv, "--track", "tensorboard,wandb"]) == 2
    err = capsys.readouterr().err
    assert err == "florist: error: tracker 'wandb' needs the wandb package, which is not installed: " + (
        "pip install -e '.[tracking]' in florist's checkout\n"
    )
    assert not (tmp_path / "results.json").exists()


def test_an_unknown_tracker_is_refused_naming_the_valid_ones(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["simulate", "--track", "tensorboard,tb", "--results-dir", str(tmp_path)])
    assert stop.value.code == 2
    assert "unknown tracker 'tb'; choose from tensorboard, mlflow, wandb" in capsys.readouterr().err
    with pytest.raises(ValueError, match="trackers must be comma-separated names of tensorboard, mlflow, wandb"):
        RunConfig.from_mapping({"trackers": "neptune"})
