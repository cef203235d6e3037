"""`florist predict` through the real CLI entry: on a node's own test split every strategy's kept
model scores exactly the accuracy its run reported; runs are told apart by run id; --data reads
an .npz, a data folder and one image; what a user gets wrong is one line."""

import functools
import json
import re

import numpy as np
import pytest
from PIL import Image

from florist.apps.registry import STRATEGIES
from florist.cli import main
from florist.client.node import node_data
from florist.client.personal import find
from florist.config import RunConfig
from florist.runners.partition import export_partition

CLIENTS = 5
# A short run of every strategy: 2 rounds, 2 of 5 clients unseen, each strategy's local work cut
# down (FedAttn's attention starts in round 2).
QUICK = {
    "num-server-rounds": 2,
    "unseen-fraction": 0.4,
    "finetune-epochs": 1,
    "hn-local-steps": 5,
    "ckt-steps": 5,
    "public-size": 60,
    "fedattn-warmup": 1,
}
SCORE = re.compile(r"^accuracy: (\d\.\d{4}) \((\d+) of (\d+) samples\)$")


def federate(values: dict, nodes: list[dict], results_dir) -> dict:
    """A run of `values` on `nodes` (node configs) in this process; its results.json."""
    from florist.apps.client import app
    from florist.apps.server import run
    from florist.common.flower_internals import server_identity
    from florist.runners.inprocess import InProcessGrid

    cfg = RunConfig.from_mapping(values | {"results-dir": str(results_dir)})
    grid = InProcessGrid(app, [{"trusted-server": True} | n for n in nodes])
    with server_identity(grid.run_id):
        run(grid, cfg, None, grid.run_id)
    return json.loads((results_dir / "results.json").read_text())


def partitions(count: int, state_dir) -> list[dict]:
    return [{"partition-id": i, "num-partitions": count, "state-dir": str(state_dir)} for i in range(count)]


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """`ran(strategy)`: (results, state folder) of a QUICK run of `strategy`, once per module."""

    @functools.cache
    def run_strategy(strategy: str) -> tuple[dict, str]:
        folder = tmp_path_factory.mktemp(strategy)
        results = federate(QUICK | {"strategy": strategy}, partitions(CLIENTS, folder / "state"), folder / "run")
        return results, str(folder / "state")

    return run_strategy


def predict(capsys, *args: str) -> tuple[int, str, list[str]]:
    """`florist predict ARGS`: (exit status, stdout, stderr's lines)."""
    capsys.readouterr()
    code = main(["predict", *args])
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


def score(lines: list[str]) -> tuple[int, int]:
    """(correct, samples) from the last line, `accuracy: A (K of N samples)`, checking A is K/N."""
    match = SCORE.match(lines[-1])
    assert match, lines
    correct, total = int(match[2]), int(match[3])
    assert match[1] == f"{correct / total:.4f}"
    return correct, total


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_predict_on_each_nodes_test_split_is_the_accuracy_its_run_reported(strategy, ran, capsys, tmp_path):
    results, state = ran(strategy)
    assert {c["seen"] for c in results["clients"]} == {True, False}
    for client in results["clients"]:
        key = client["client"]
        out = tmp_path / f"{key}.json"
        code, _, lines = predict(capsys, "--node-key", key, "--state-dir", state, "--split", "test", "--out", str(out))
        assert code == 0, lines
        assert lines[0].startswith(f"model: node {key}, {strategy}, run {results['run_id']}, round "), lines
        correct, total = score(lines)
        assert total == client["num_test"] and correct / total == client["accuracy"]
        written = json.loads(out.read_text())
        assert written["accuracy"] == client["accuracy"] and written["correct"] == correct
    code, rows, lines = predict(capsys, "--node-key", key, "--state-dir", state, "--split", "test")  # CSV on stdout
    header, *body = rows.strip().splitlines()
    assert code == 0 and header == "index,class,class_name," + ",".join(f"p_{c}" for c in range(10))
    assert [int(row.split(",")[1]) for row in body] == [r["class"] for r in written["predictions"]]
    # the digits name themselves
    assert [row.split(",")[2] for row in body] == [str(r["class"]) for r in written["predictions"]]


def test_odpfl_predicts_for_an_unlabeled_node_and_prints_no_accuracy(capsys, tmp_path):
    values = QUICK | {"strategy": "odpfl", "unseen-fraction": 0.0}
    data = tmp_path / "newcomer"
    export_partition(values, 4, CLIENTS, data, unlabeled=True)
    state = tmp_path / "state"
    newcomer = {"data-dir": str(data), "node-key": "newcomer", "unseen": True, "state-dir": str(state)}
    results = federate(values, [*partitions(CLIENTS - 1, state), newcomer], tmp_path / "run")
    [served] = [c for c in results["clients"] if c["client"] == "newcomer"]
    assert served.get("accuracy") is None  # nobody could score it
    code, rows, lines = predict(capsys, "--node-key", "newcomer", "--state-dir", str(state), "--split", "test")
    assert code == 0 and "no accuracy" in lines[0] and not any(line.startswith("accuracy") for line in lines)
    assert len(rows.strip().splitlines()) == 1 + len(np.load(data / "test.npz")["x"])
    np.savez(data / "test.npz", x=np.load(data / "test.npz")["x"][:5])  # the box's data changed since the run
    code, rows, lines = predict(capsys, "--node-key", "newcomer", "--state-dir", str(state), "--split", "test")
    assert code == 0 and len(rows.strip().splitlines()) == 6
    assert any(line.startswith("note: node newcomer's test split is not the data the run scored") for line in lines)


def test_two_runs_keep_two_models_the_latest_is_the_default_and_run_id_picks_either(capsys, tmp_path):
    state = tmp_path / "state"
    values = {"strategy": "fedavg", "num-server-rounds": 1, "unseen-fraction": 0.0}
    first = federate(values, partitions(3, state), tmp_path / "first")
    second = federate(values | {"lr": 0.02}, partitions(3, state), tmp_path / "second")
    assert first["run_id"] != second["run_id"]
    node = ["--node-key", "partition-1", "--state-dir", str(state), "--split", "test"]
    for results, pick in (
        (second, []),
        (first, ["--run-id", str(first["run_id"])]),
        (second, ["--run-id", str(second["run_id"])]),
    ):
        code, _, lines = predict(capsys, *node, *pick)
        assert code == 0 and f"run {results['run_id']}," in lines[0]
        correct, total = score(lines)
        assert correct / total == results["clients"][1]["accuracy"]
    assert first["clients"][1]["accuracy"] != second["clients"][1]["accuracy"]  # so the check above tells them apart
    folder = state / "partition-1" / "models" / str(first["run_id"])
    code, _, lines = predict(capsys, "--model", str(folder), "--split", "test")
    assert code == 0 and f"run {first['run_id']}," in lines[0]
    code, _, lines = predict(capsys, *node, "--run-id", "12345")
    assert code == 2 and len(lines) == 1
    assert (
        "no model of run 12345" in lines[0] and str(first["run_id"]) in lines[0] and str(second["run_id"]) in lines[0]
    )


def _knnper_node(ran) -> tuple[dict, str, dict]:
    """A kNN-Per run's state folder, its client partition-0's results, and that node's test split."""
    results, state = ran("knnper")
    kept = find(state, "partition-0")
    d = node_data(kept.manifest["node_config"], RunConfig.from_mapping(kept.manifest["run_config"]))
    return results["clients"][0], state, {"x": d.x_test, "y": d.y_test, "x_train": d.x_train, "y_train": d.y_train}


def test_data_as_npz_file_and_as_join_folder_scores_as_the_node_split(ran, capsys, tmp_path):
    client, state, split = _knnper_node(ran)
    np.savez(tmp_path / "test.npz", x=split["x"], y=split["y"])
    np.savez(tmp_path / "train.npz", x=split["x_train"], y=split["y_train"])
    for data in (tmp_path / "test.npz", tmp_path):  # a join folder: its test split
        code, _, lines = predict(capsys, "--node-key", "partition-0", "--state-dir", state, "--data", str(data))
        assert code == 0, lines
        correct, total = score(lines)
        assert correct / total == client["accuracy"]


def test_data_as_image_folder_and_one_png_give_the_classes_of_the_same_pixels(ran, capsys, tmp_path):
    _, state, split = _knnper_node(ran)
    pixels = np.round(split["x"] * 255).astype(np.uint8)  # what a PNG holds
    np.savez(tmp_path / "pixels.npz", x=pixels, y=split["y"])
    for i, (image, label) in enumerate(zip(pixels, split["y"])):
        (tmp_path / "images" / "test" / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[0], mode="L").save(tmp_path / "images" / "test" / str(label) / f"{i:04d}.png")
    node = ["--node-key", "partition-0", "--state-dir", state]
    expected = [int(c) for c in _classes(capsys, *node, "--data", str(tmp_path / "pixels.npz"))]
    order = sorted(range(len(pixels)), key=lambda i: (str(split["y"][i]), i))  # ImageFolder's: class, then name
    assert _classes(capsys, *node, "--data", str(tmp_path / "images")) == [str(expected[i]) for i in order]
    # each row names its image file (issue 54: an index alone could not be traced back)
    files = [str(tmp_path / "images" / "test" / str(split["y"][i]) / f"{i:04d}.png") for i in order]
    assert _classes(capsys, *node, "--data", str(tmp_path / "images"), column="file") == files
    assert np.mean(np.array(expected) == split["y"]) > 0.5  # right classes, mostly: chance is 0.1
    one = tmp_path / "images" / "test" / str(split["y"][7]) / "0007.png"
    assert _classes(capsys, *node, "--data", str(one)) == [str(expected[7])]
    for data, out in ((one, "one.json"), (tmp_path / "pixels.npz", "all.json")):  # the same input, as join reads it
        assert predict(capsys, *node, "--data", str(data), "--out", str(tmp_path / out))[0] == 0
    [alone], together = (json.loads((tmp_path / f).read_text())["predictions"] for f in ("one.json", "all.json"))
    assert alone["file"] == str(one) and "file" not in together[7]  # an .npz has no files to name
    np.testing.assert_allclose(alone["probabilities"], together[7]["probabilities"], rtol=0, atol=1e-6)


def _classes(capsys, *args: str, column: str = "class") -> list[str]:
    code, rows, lines = predict(capsys, *args)
    assert code == 0, lines
    header, *body = rows.strip().splitlines()
    at = header.split(",").index(column)
    return [row.split(",")[at] for row in body]


def test_what_a_user_gets_wrong_is_one_line(ran, capsys, tmp_path):
    _, state = ran("knnper")
    np.savez(tmp_path / "wide.npz", x=np.zeros((3, 1, 9, 9), np.float32))
    (tmp_path / "broken.npz").write_bytes(b"not an npz")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    node = ["--node-key", "partition-0", "--state-dir", state]
    cases = [
        (["--node-key", "partition-0", "--state-dir", str(tmp_path / "empty"), "--split", "test"], "keeps no model"),
        (["--node-key", "nobody", "--state-dir", state, "--split", "test"], "nodes that do: partition-0"),
        (
            ["--state-dir", state, "--split", "test"],
            "nodes partition-0, .* keep models there; --node-key names the node",
        ),
        (
            [*node, "--data", str(tmp_path / "wide.npz")],
            r"wide.npz: samples of shape \(1, 9, 9\).* expects \(1, 8, 8\)",
        ),
        ([*node, "--data", str(tmp_path / "broken.npz")], "broken.npz is not a readable .npz"),
        ([*node, "--data", str(tmp_path / "broken.png")], r"broken.png: cannot be read as an image \(.+\)$"),
        ([*node, "--data", str(tmp_path / "absent.npz")], "absent.npz does not exist"),
        (
            [*node, "--split", "test", "--out", str(tmp_path / "rows.txt")],
            r"rows.txt: expected a file ending in .csv or .json",
        ),
    ]
    cases.append(([*node, "--split", "test", "--out", "/dev/null/rows.csv"], "rows.csv: cannot write it"))
    for args, message in cases:
        code, rows, lines = predict(capsys, *args)
        assert code == 2 and len(lines) == 1 and re.search(message, lines[0]), (args, lines)
        assert lines[0].startswith("florist: error: ") and not rows
    assert not (tmp_path / "rows.txt").exists()


def test_rows_the_manifest_and_the_export_name_each_class(make_node, tmp_path):
    """Issue 54: a row said `class 1`; which class that is was the user's to work out. A folder's
    class folders name its classes, the embedded digits their digit, in the kept manifest, the
    rows of `florist predict` and the exported module."""
    import torch

    from florist.common import folders
    from florist.runners import export, predict

    for i in range(12):
        (tmp_path / "own" / ("cat", "dog")[i % 2]).mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((8, 8), 20 * i, dtype=np.uint8)).save(
            tmp_path / "own" / ("cat", "dog")[i % 2] / f"{i}.png"
        )
    own = {"data-dir": str(tmp_path / "own")}
    values = {"num-server-rounds": 2, "num-classes": 3}
    data = folders.folder_client(tmp_path / "own", 3, 0, 0.2, folders.ImageOptions(), 0.3)
    node = make_node(values, data=data, node_config=own, server_round=3)
    node.test_reply(node.new_model())  # the final evaluation keeps the model
    kept = find(tmp_path / "state", node.key)
    assert kept.manifest["class_names"] == ["cat", "dog", "2"]  # a class no folder holds: its number
    prediction = predict.predict(kept, predict.Samples(data.x_test, data.y_test, "test"))
    header, *rows = predict.csv_lines(prediction)
    assert header.startswith("index,class,class_name,p_0")
    assert [row.split(",")[2] for row in rows] == [kept.class_names[c] for c in prediction.classes]
    assert predict.as_json(prediction)["predictions"][0]["class_name"] in ("cat", "dog", "2")
    done = export.export(kept, tmp_path / "export")
    assert torch.jit.load(str(done.module)).class_names == ["cat", "dog", "2"]
    assert json.loads(done.manifest.read_text())["class_names"] == ["cat", "dog", "2"]
    digits = make_node(values | {"num-classes": 10}, key="partition-1", server_round=3)
    digits.test_reply(digits.new_model())
    assert find(tmp_path / "state", "partition-1").class_names == [str(c) for c in range(10)]
