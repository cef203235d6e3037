"""End-to-end runs in Flower's simulation runtime (Ray workers, real messages), and the
in-process federation checked against it."""

import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message

from florist.apps.client import build_client_app
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.runners.simulation import simulate
from florist.strategies.knnper import client as knn


def _run(tmp_path, name, client_app=None, runner=simulate, **overrides):
    values = {
        "num-server-rounds": 3,
        "local-epochs": 2,
        "partition": "iid",
        "min-nodes": 6,
        "results-dir": str(tmp_path / name),
    }
    cfg = RunConfig.from_mapping(values | overrides)
    return runner(cfg, 6, client_app=client_app)


@pytest.fixture(scope="module")
def fedavg_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("sim"), "fedavg", partition="dirichlet:0.5")


def test_fedavg_learns_and_writes_the_documented_results(fedavg_run, tmp_path_factory):
    results = fedavg_run
    assert results["strategy"] == "fedavg" and results["complete"]
    assert [r["round"] for r in results["rounds"]] == [1, 2, 3]
    for row in results["rounds"]:
        assert set(row) == {"round", "seconds", "bytes_up", "bytes_down", "train_loss", "accuracy", "exchanges"}
        assert row["bytes_up"] > 0 and row["bytes_down"] > 0 and math.isfinite(row["train_loss"])
        assert [e["type"] for e in row["exchanges"]] == ["train", "evaluate"]  # where the round's time went
        assert all(e["nodes"] == 5 and 0 < e["handler_seconds_max"] < e["seconds"] for e in row["exchanges"])
    assert results["rounds"][-1]["train_loss"] < results["rounds"][0]["train_loss"]
    seen, unseen = results["summary"]["seen"], results["summary"]["unseen"]
    assert seen["num_clients"] == 5 and unseen["num_clients"] == 1  # 0.2 × 6 held out
    assert seen["mean_accuracy"] > 0.4  # chance is 0.1
    assert set(seen) == {"mean_accuracy", "bottom_decile_accuracy", "num_clients"}
    for client in results["clients"]:
        assert {"client", "seen", "num_train", "num_test", "accuracy"} <= set(client)
    names = {p.name for p in Path(results["config"]["results-dir"]).iterdir()}
    assert {"results.json", "report.md", "accuracy_per_round.png", "client_accuracy.png", "checkpoint.pt"} <= names


def test_same_seed_same_per_client_accuracies_in_process_as_in_simulation(fedavg_run, tmp_path):
    """The in-process federation the strategy tests use is the simulation, minus Ray."""
    again = _run(tmp_path, "again", runner=run_in_process, partition="dirichlet:0.5")
    key = lambda r: [(c["client"], c["accuracy"]) for c in r["clients"]]  # noqa: E731
    assert key(again) == key(fedavg_run)
    assert [r["train_loss"] for r in again["rounds"]] == [r["train_loss"] for r in fedavg_run["rounds"]]


def fail_in_round_two(msg: Message, context: Context, call_next):
    """A Flower mod: partition 2 crashes while training in round 2."""
    config = msg.content.config_records.get("config", {})
    if (
        context.node_config["partition-id"] == 2
        and msg.metadata.message_type == "train"
        and config.get("server-round") == 2
    ):
        raise RuntimeError("disk on fire")
    return call_next(msg, context)


def test_a_node_failing_mid_round_is_left_out_and_the_run_completes(tmp_path):
    results = _run(
        tmp_path,
        "fail",
        client_app=build_client_app(mods=[fail_in_round_two]),
        runner=run_in_process,
        **{"unseen-fraction": 0.0},
    )
    assert results["complete"] and len(results["rounds"]) == 3
    [failure] = results["failures"]
    assert failure["round"] == 2 and failure["message_type"] == "train"
    assert "partition-2" in failure["node"] and "disk on fire" in failure["reason"]
    assert all(math.isfinite(r["train_loss"]) for r in results["rounds"])
    assert all(c["accuracy"] is not None for c in results["clients"])  # it is back for evaluation


@pytest.mark.parametrize("strategy", ["local", "fedavg-ft", "knnper"])
def test_personalized_strategies_score_every_client(tmp_path, strategy):
    results = _run(
        tmp_path,
        strategy,
        runner=run_in_process,
        strategy=strategy,
        partition="pathological:2",
        **{"num-server-rounds": 2},
    )
    assert results["summary"]["unseen"]["num_clients"] == 1
    assert all(c["accuracy"] is not None for c in results["clients"])
    if strategy in ("fedavg-ft", "knnper"):
        assert all("global_accuracy" in c for c in results["clients"])
    if strategy == "knnper":
        assert all(c["lambda"] in knn.LAMBDA_GRID and c["k"] in (5, 10) for c in results["clients"])
        assert all(c["datastore_size"] > c["num_train"] for c in results["clients"])  # train split and validation pairs
        mean = lambda key: np.mean([c[key] for c in results["clients"]])  # noqa: E731
        assert mean("accuracy") >= mean("global_accuracy")  # λ is tuned on validation, so it rarely hurts
        plotted = (Path(results["config"]["results-dir"]) / "lambda_vs_size.png").exists()
        assert plotted == (len({c["lambda"] for c in results["clients"]}) > 1)  # one λ for all: said, not drawn
    # on 2-class clients a personal model beats chance by far
    assert results["summary"]["seen"]["mean_accuracy"] > 0.6


def test_florist_simulate_runtime_in_process_gives_the_simulations_results(fedavg_run, tmp_path, capsys):
    """`florist simulate --runtime in-process`: the command a user types, no Ray, the same clients' scores."""
    import json

    from florist.cli import main

    args = [
        "simulate",
        "--runtime",
        "in-process",
        "--num-clients",
        "6",
        "--rounds",
        "3",
        "--partition",
        "dirichlet:0.5",
    ]
    assert main([*args, "--run-config", "local-epochs=2", "--results-dir", str(tmp_path / "cli")]) == 0
    results = json.loads((tmp_path / "cli" / "results.json").read_text())
    assert results["complete"] and "wall time" in capsys.readouterr().err
    assert [(c["client"], c["accuracy"]) for c in results["clients"]] == [
        (c["client"], c["accuracy"]) for c in fedavg_run["clients"]
    ]


def reported_loss(value: float):
    """A mod with a parameter of its own, as `LocalDpMod` is: every `train` reply reports `value`
    as its loss. Built in a function, so Ray's workers get it by value, as they get a user's."""

    class ReportedLoss:
        def __call__(self, msg: Message, context: Context, call_next):
            reply = call_next(msg, context)
            if msg.metadata.message_type == "train" and reply.has_content():
                reply.content["metrics"]["train-loss"] = value
            return reply

    return ReportedLoss()


@pytest.mark.parametrize("runner", [simulate, run_in_process])
def test_build_client_app_with_a_mod_works_wherever_app_does(tmp_path, runner):
    """`app` pickles by name; an app with mods must reach Ray's workers with the registry too."""
    cfg = RunConfig.from_mapping(
        {"num-server-rounds": 1, "partition": "iid", "min-nodes": 3, "results-dir": str(tmp_path)}
    )
    results = runner(cfg, 3, client_app=build_client_app(mods=[reported_loss(123.0)]))
    assert results["complete"] and not results.get("failures")
    assert [r["train_loss"] for r in results["rounds"]] == [123.0]
