"""`florist datastore add` grows the kept kNN-Per model's store too, so `florist predict` uses
new samples at once: the paper's distribution-shift case, adapting without retraining."""

import numpy as np
import pytest

from florist.cli import main
from florist.client import personal
from florist.client.node import node_data
from florist.common import data as data_lib
from florist.common import training
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.runners.predict import probabilities
from florist.strategies.knnper import client as knnper


def _rotated(x: np.ndarray) -> np.ndarray:
    """Digits turned by 90°: the shift the global model never saw."""
    return np.ascontiguousarray(np.rot90(x, 1, axes=(2, 3)))


def _folder(path, train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray]):
    """A node data folder as `join` reads it."""
    path.mkdir()
    for split, (x, y) in (("train", train), ("test", test)):
        np.savez(path / f"{split}.npz", x=x, y=y)
    return path


def _accuracy(kept: personal.Kept, x: np.ndarray, y: np.ndarray) -> float:
    return float((probabilities(kept, x).argmax(1) == y).mean())


def test_added_shifted_samples_lift_the_kept_models_accuracy_without_touching_its_network(
    tmp_path, monkeypatch, capsys
):
    """A short kNN-Per run on digits; one node's kept model scores rotated digits near chance.
    Its own train and validation digits, rotated, go into the store with `datastore add`; on
    its rotated test digits (never added) the same kept model, found again as `predict` finds
    it, is then far better, with its weights byte for byte the same and its reported accuracy
    unchanged."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the default state root, this test's alone
    values = {"strategy": "knnper", "num-server-rounds": 2, "local-epochs": 1, "partition": "iid", "min-nodes": 4}
    results = run_in_process(RunConfig.from_mapping(values | {"results-dir": str(tmp_path / "run")}), 4)
    client = max(results["clients"], key=lambda c: c["lambda"])  # the kNN's weight in its mixture: λ > 0
    key = client["client"]
    kept = personal.find(None, key)
    d = node_data(kept.manifest["node_config"], RunConfig.from_mapping(kept.manifest["run_config"]))
    shifted_test = _rotated(d.x_test), d.y_test
    before = _accuracy(kept, *shifted_test)
    weights, size = (kept.folder / personal.WEIGHTS).read_bytes(), len(kept.extras()["labels"])
    new = _rotated(np.concatenate([d.x_train, d.x_val])), np.concatenate([d.y_train, d.y_val])
    folder = _folder(tmp_path / "rotated", new, shifted_test)  # its test split is never added

    assert main(["datastore", "add", "--node-key", key, "--data-dir", str(folder)]) == 0

    line = capsys.readouterr().out.strip().splitlines()[-1]
    grown = personal.find(None, key)
    after = _accuracy(grown, *shifted_test)
    print(f"{key} (λ = {client['lambda']}): rotated test accuracy {before:.4f} -> {after:.4f}")
    assert before < 0.35 and after > 0.8  # chance is 0.1
    assert (grown.folder / personal.WEIGHTS).read_bytes() == weights
    assert grown.manifest["accuracy"] == kept.manifest["accuracy"] == client["accuracy"]
    assert grown.manifest["added"][0]["count"] == len(new[1]) and len(grown.extras()["labels"]) == size + len(new[1])
    assert line.count("->") == 2 and f"{size} -> {size + len(new[1])} entries" in line, line


@pytest.fixture
def kept_runs(make_node):
    """Node partition-4 keeps a kNN-Per model (run 1, store capped at 50 by fifo), then a
    FedAvg one (run 2, later), each at its run's final evaluation (round 2 of a 1-round run);
    its state holds no datastore."""
    values = {"strategy": "knnper", "knn-policy": "fifo", "knn-capacity": 50, "num-server-rounds": 1}
    node = make_node(values, run_id=1, server_round=2)
    model = node.new_model()
    store = knnper.Datastore(training.embed(model, node.data.x_train[:1]).shape[1], "flat", 50, "fifo")
    store.add(training.embed(model, node.data.x_train), node.data.y_train)
    knnper.keep(node, model, knnper.personalize(node, model, store))
    other = make_node({"strategy": "fedavg", "num-server-rounds": 1}, run_id=2, server_round=2)
    personal.keep(other, other.new_model(), None)
    return node


def _add(node, folder, *more: str) -> int:
    root = str(node.state.folder.parent)
    return main(["datastore", "add", "--state-dir", root, "--node-key", node.key, "--data-dir", str(folder), *more])


def test_add_grows_the_latest_knnper_model_under_its_runs_policy(kept_runs, tmp_path, capsys):
    x, y = data_lib.load_digits()
    folder = _folder(tmp_path / "new", (x[:20], y[:20]), (x[20:30], y[20:30]))
    assert _add(kept_runs, folder) == 0  # the latest kept model is FedAvg's: the kNN-Per one is grown

    kept = personal.find(kept_runs.state.folder.parent, kept_runs.key, 1)
    stored = kept.extras()
    assert len(stored["labels"]) == 50  # fifo: the newest 50, the folder's 20 train samples last
    distances = ((stored["embeddings"][-20:, None] - training.embed(kept.network(), x[:30])[None]) ** 2).sum(-1)
    assert sorted(distances.argmin(1).tolist()) == list(range(20)) and np.allclose(distances.min(1), 0, atol=1e-8)
    added = kept.manifest["added"]
    assert [(a["count"], a["before"], a["after"], a["data"][:3]) for a in added] == [(20, 50, 50, "20-")]
    out = capsys.readouterr().out
    assert (
        out.count("\n") == 1 and "no state datastore in" in out and "kept model of run 1" in out and "50 -> 50" in out
    )


def test_a_run_of_another_strategy_or_a_bad_folder_is_one_line_and_writes_nothing(kept_runs, tmp_path, capsys):
    kept = personal.find(kept_runs.state.folder.parent, kept_runs.key, 1)
    files = {p.name: p.read_bytes() for p in kept.folder.iterdir()}
    x, y = data_lib.load_digits()
    good = _folder(tmp_path / "good", (x[:20], y[:20]), (x[20:30], y[20:30]))
    wide = _folder(tmp_path / "wide", (np.zeros((4, 1, 8, 9), np.float32), y[:4]), (np.zeros((2, 1, 8, 9)), y[:2]))
    assert _add(kept_runs, good, "--run-id", "2") == 2
    assert "strategy 'fedavg''s, not knnper's" in capsys.readouterr().err
    assert _add(kept_runs, good, "--run-id", "3") == 2
    assert "kept no model of run 3" in capsys.readouterr().err
    assert _add(kept_runs, wide) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the datastore's model expects (1, 8, 8)" in err, err
    assert {p.name: p.read_bytes() for p in kept.folder.iterdir()} == files
