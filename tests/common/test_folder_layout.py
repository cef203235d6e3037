"""One image-folder layout for `simulate`, `compare` and `join`: class folders, or train/ with an
optional test/. With test/, a simulated client is tested on its share of test/ in its own
classes' proportions (`hub.deal`); a node reads the same folder whatever its layout; and every
image of a dataset is decoded to one size, whatever a partition holds.

Every image carries its identity in its first row: pixel 0 is 255 in test/ and 0 in train/,
pixel 1 its number, pixel 2 its class folder's index times 50."""

import json

import numpy as np
import pytest
from PIL import Image

from florist.common import folders, hub, scenarios
from florist.config import RunConfig

TRAIN = {"a": 12, "b": 12, "c": 12}
TEST = {"b": 7, "c": 8}  # no test image of class a: its id must not shift b's and c's


def _write(folder, counts: dict[str, int], marker: int, sizes=lambda c, i: (8, 8)) -> None:
    """Grayscale PNGs `folder/<class>/<i>.png` marked as the module says, `sizes(class, i)` each."""
    rng = np.random.default_rng(marker)
    for c, count in counts.items():
        (folder / c).mkdir(parents=True)
        for i in range(count):
            pixels = rng.integers(0, 256, sizes(c, i), dtype=np.uint8)
            pixels[0, :3] = marker, i + 100 * "abc".index(c), 50 * "abc".index(c)
            Image.fromarray(pixels).save(folder / c / f"{i}.png")


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout") / "photos"
    _write(root / "train", TRAIN, 0)
    _write(root / "test", TEST, 255)
    return root


def _cfg(dataset, **values) -> RunConfig:
    return RunConfig.from_mapping({"dataset": str(dataset), "partition": "pathological:2", "seed": 3} | values)


def test_a_simulated_clients_test_set_is_its_share_of_test_in_its_training_proportions(photos, tmp_path):
    from florist.cli import main

    clients = [scenarios.client_data(i, 3, _cfg(photos)) for i in range(3)]
    ids = []
    for data in clients:
        assert (data.x_train[:, 0, 0, 0] == 0).all() and (data.x_val[:, 0, 0, 0] == 0).all()  # no test/ image trains
        assert (data.x_test[:, 0, 0, 0] == 255).all()  # every test image from test/
        assert (data.x_test[:, 0, 0, 2] == 50 * data.y_test).all()  # with its class's id (a, absent, shifts none)
        ids += data.x_test[:, 0, 0, 1].tolist()
    assert sorted(ids) == sorted(i + 100 * "abc".index(c) for c, n in TEST.items() for i in range(n))  # each once
    held = np.stack([np.bincount(np.concatenate([d.y_train, d.y_val]), minlength=3) for d in clients])
    for c in (1, 2):  # b and c: shares follow the training counts within 1, none without the class
        got = np.array([(d.y_test == c).sum() for d in clients])
        expected = TEST["abc"[c]] * held[:, c] / held[:, c].sum()
        assert (np.abs(got - expected) < 1).all() and (got[held[:, c] == 0] == 0).all()

    args = ["simulate", "--runtime", "in-process", "--dataset", str(photos), "--partition", "pathological:2"]
    args += ["--num-clients", "3", "--rounds", "1", "--unseen-fraction", "0", "--seed", "3"]
    assert main([*args, "--results-dir", str(tmp_path / "out"), "--run-config", "min-train-nodes=1"]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {c["client"]: c["num_test"] for c in results["clients"]} == {
        f"partition-{i}": len(d.x_test) for i, d in enumerate(clients)
    }


def test_compare_takes_num_classes_from_the_folders_classes_as_simulate_does(photos, tmp_path):
    """A comparison on a 4-class folder ran with num-classes 10 (issue 54's walk): FedAvg's model
    put weight on 6 classes no image has and scored 13 % against 43 % with 4."""
    from florist.cli import main

    args = ["--runtime", "in-process", "--dataset", str(photos), "--num-clients", "3", "--rounds", "1"]
    assert main(["compare", "--strategies", "local", "--seeds", "1", *args, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "local" / "seed1" / "results.json").read_text())
    assert results["config"]["num-classes"] == len(TRAIN) == 3


def test_without_test_each_client_splits_its_own_images_and_the_cache_follows_the_layout(photos, tmp_path):
    import shutil

    root = tmp_path / "photos"
    shutil.copytree(photos / "train", root / "train")  # train/ alone: the images of `photos`, not its tests
    alone = [scenarios.client_data(i, 3, _cfg(root)) for i in range(3)]
    assert all((d.x_test[:, 0, 0, 0] == 0).all() and len(d.x_test) for d in alone)  # a test-fraction of its own
    assert sum(len(d.x_train) + len(d.x_val) + len(d.x_test) for d in alone) == sum(TRAIN.values())
    shutil.copytree(photos / "test", root / "test")  # the same folder, a test/ added: decoded again, not cached
    assert all((scenarios.client_data(i, 3, _cfg(root)).x_test[:, 0, 0, 0] == 255).all() for i in range(3))


def test_deal_rounds_by_largest_remainder_and_leaves_out_no_test_image_of_a_held_class():
    held = np.array([[3, 0], [1, 0], [0, 0]])  # class 1: no client holds it
    parts = hub.deal(np.array([0] * 6 + [1] * 2), held, seed=0)
    assert [len(p) for p in parts] == [5, 1, 0]  # 4.5 and 1.5: a tie, to the lower client id
    assert sorted(np.concatenate(parts).tolist()) == [0, 1, 2, 3, 4, 5]
    assert [p.tolist() for p in hub.deal(np.array([0] * 6 + [1] * 2), held, seed=0)] == [p.tolist() for p in parts]


def test_a_nodes_folder_may_be_class_folders_or_train_alone(photos, tmp_path):
    import shutil

    n = sum(TRAIN.values())
    shutil.copytree(photos / "train", tmp_path / "only" / "train")
    for root in (photos / "train", tmp_path / "only"):  # class folders; train/ without test/
        data = folders.folder_client(root, 3, seed=1, val_fraction=0.2, test_fraction=0.25)
        assert (len(data.x_train), len(data.x_val), len(data.x_test)) == (n - 9 - 7, 7, 9)
        rows = np.concatenate([data.x_train, data.x_val, data.x_test])[:, 0, 0, 1]
        assert sorted(rows.tolist()) == sorted(i + 100 * "abc".index(c) for c, k in TRAIN.items() for i in range(k))
    both = folders.folder_client(photos, 3, seed=1, val_fraction=0.2)  # train/ and test/: test/ is the test set
    assert (both.x_test[:, 0, 0, 0] == 255).all() and len(both.x_test) == sum(TEST.values())
    assert (both.x_test[:, 0, 0, 2] == 50 * both.y_test).all()  # b is 1 in test/ too, though test/ lacks a
    shutil.copytree(photos / "test", tmp_path / "no-train" / "test")
    with pytest.raises(FileNotFoundError, match=r"holds test/ but no train/ \(nor class folders\); expected train.npz"):
        folders.folder_client(tmp_path / "no-train", 3, seed=1, val_fraction=0.2)


def test_a_node_splits_its_class_folders_as_the_run_says(photos, tmp_path, monkeypatch):
    from florist.client.node import node_data

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # its own decode cache
    cfg = RunConfig.from_mapping({"test-fraction": 0.5, "val-fraction": 0.1})
    data = node_data({"data-dir": str(photos / "train")}, cfg)
    assert len(data.x_test) == sum(TRAIN.values()) // 2  # the run's test-fraction, not the default 0.2


def _mixed(c: str, i: int) -> tuple[int, int]:
    """Half the images 8×8, half 6×6, but class a mostly 8×8 and class b mostly 6×6."""
    return (8, 8) if (i < 6) == (c == "a") else (6, 6)


def test_every_partition_keeps_the_datasets_most_common_size(tmp_path):
    _write(tmp_path / "mixed", {"a": 10, "b": 10}, 0, _mixed)
    cfg = _cfg(tmp_path / "mixed", partition="pathological:1", **{"skip-bad-images": True, "num-classes": 2})
    one_class_each = [scenarios.client_data(i, 2, cfg) for i in range(2)]
    assert [set(d.y_train.tolist()) for d in one_class_each] == [{0}, {1}]
    assert [d.input_shape for d in one_class_each] == [(1, 8, 8)] * 2  # a 10/10 tie: the larger size
    assert [d.skipped_images for d in one_class_each] == [4, 6]
    _write(tmp_path / "node" / "train", {"a": 10}, 0, _mixed)  # train/ mostly 8×8, test/ mostly 6×6
    _write(tmp_path / "node" / "test", {"b": 9}, 255, _mixed)
    node = folders.folder_client(tmp_path / "node", 2, 0, 0.2, folders.ImageOptions(skip_bad=True))
    assert node.input_shape == node.x_test.shape[1:] == (1, 6, 6) and node.skipped_images == 6 + 3


def test_predict_scores_a_data_folder_on_the_test_split_its_node_has(photos, tmp_path):
    import shutil

    from florist.runners.predict import read

    cfg = RunConfig.from_mapping({"seed": 3, "test-fraction": 0.25})
    shutil.copytree(photos / "train", tmp_path / "only" / "train")
    for root in (photos, tmp_path / "only"):  # train/ and test/ (test/ lacks class a); train/ alone
        node = folders.folder_client(
            root, 3, cfg.seed, cfg.val_fraction, folders.ImageOptions.of(cfg), cfg.test_fraction
        )
        samples = read(root, 3, cfg)
        assert np.array_equal(samples.x, node.x_test) and np.array_equal(samples.y, node.y_test)
    assert set(read(photos, 3, cfg).y.tolist()) == {1, 2}  # b and c keep their ids though test/ has no a
