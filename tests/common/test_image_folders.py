"""Image folders as real teams have them: a truncated PNG, one image of another size, three
class folders. Without options the first error names the bad file; with `skip-bad-images` and
`image-size` a run completes, on `simulate`'s path (`common/hub.py`) and `join`'s
(`common/folders.py`, through a node's `_cached_folder`) alike."""

import json
import logging
import re
import shutil

import numpy as np
import pytest
from PIL import Image

from florist.client import node as node_lib
from florist.common import folders, hub, scenarios
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process

PER_CLASS = 6
SKIP_AND_RESIZE = {"skip-bad-images": True, "image-size": "64,64"}


def _write(root, truncated: bool) -> None:
    """3 class folders of 64×64 RGB PNGs, one 48×48 and, with `truncated`, one cut short."""
    rng = np.random.default_rng(0)
    for c in "abc":
        (root / c).mkdir(parents=True)
        for i in range(PER_CLASS):
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(root / c / f"{i}.png")
    Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)).save(root / "b" / "small.png")
    if truncated:
        (root / "a" / "0.png").write_bytes((root / "a" / "0.png").read_bytes()[:200])


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images") / "photos"
    _write(root, truncated=True)
    return root


@pytest.fixture(scope="module")
def node_folder(images, tmp_path_factory):
    """The same images as a node's `data-dir`: ImageFolder trees train/ and test/."""
    root = tmp_path_factory.mktemp("node")
    for split in ("train", "test"):
        shutil.copytree(images, root / split)
    return root


def _cfg(dataset, **values) -> RunConfig:
    return RunConfig.from_mapping({"dataset": str(dataset), "partition": "iid", "num-classes": 3} | values)


def _one_line(err: pytest.ExceptionInfo, path) -> None:
    assert str(path) in str(err.value) and "\n" not in str(err.value) and "skip-bad-images=true" in str(err.value)


def test_a_bad_image_is_named_with_its_path_and_what_was_expected(images, node_folder, tmp_path):
    with pytest.raises(ValueError, match=r"a/0\.png: cannot be read as an image \(") as err:  # simulate's path
        scenarios.client_data(0, 1, _cfg(images))
    _one_line(err, images / "a" / "0.png")
    with pytest.raises(ValueError, match=r"train/a/0\.png: cannot be read as an image \(") as err:  # join's path
        folders.folder_client(node_folder, 3, 0, 0.2)
    _one_line(err, node_folder / "train" / "a" / "0.png")

    _write(tmp_path / "sizes", truncated=False)  # no truncated file: the other size is named
    wrong_size = r"b/small\.png: is 48×48 RGB where the most common size is 64×64 RGB; set image-size=64,64"
    with pytest.raises(ValueError, match=wrong_size) as err:
        scenarios.client_data(0, 1, _cfg(tmp_path / "sizes"))
    _one_line(err, tmp_path / "sizes" / "b" / "small.png")
    with pytest.raises(ValueError, match=wrong_size):
        folders.read_image_folder(tmp_path / "sizes", 3)


def test_with_skip_and_resize_a_run_completes_with_three_classes(images, tmp_path, caplog):
    cfg = _cfg(
        images, **SKIP_AND_RESIZE, **{"num-server-rounds": 1, "results-dir": str(tmp_path), "model": "mobilenet_v2"}
    )
    assert hub.class_count(cfg, 2) == 3  # what num-classes is when not given
    with caplog.at_level(logging.WARNING, "florist.common.folders"):
        clients = [scenarios.client_data(i, 2, cfg) for i in range(2)]
    assert sum(len(c.x_train) + len(c.x_val) + len(c.x_test) for c in clients) == 3 * PER_CLASS  # 19 files, 1 skipped
    assert all(c.input_shape == (3, 64, 64) for c in clients)
    assert "skipped 1 bad image files (skip-bad-images): " in caplog.text and "a/0.png" in caplog.text
    results = run_in_process(cfg, 2)
    assert results["complete"] and len(results["clients"]) == 2 and not results["failures"]
    assert results["config"]["num-classes"] == 3


def test_a_node_reads_its_folder_with_the_runs_image_settings(node_folder):
    cfg = RunConfig.from_mapping({"num-classes": 3} | SKIP_AND_RESIZE)
    data = node_lib.node_data({"data-dir": str(node_folder)}, cfg)
    assert len(data.x_train) + len(data.x_val) == len(data.x_test) == 3 * PER_CLASS  # the truncated file left out
    assert data.input_shape == (3, 64, 64) and set(data.y_test.tolist()) == {0, 1, 2}
    # decoded once per setting: another image-size is decoded again, not read from the cache
    smaller = node_lib.node_data({"data-dir": str(node_folder)}, cfg.replace(image_size="16,16"))
    assert smaller.input_shape == (3, 16, 16)
    with pytest.raises(ValueError, match=r"train/a/0\.png: cannot be read"):  # and skipping is a setting too
        node_lib.node_data({"data-dir": str(node_folder)}, cfg.replace(skip_bad_images=False))
    # a box's own node config may skip its bad files whatever the server says
    own = {"data-dir": str(node_folder), "skip-bad-images": True}
    assert node_lib.node_data(own, cfg.replace(skip_bad_images=False)).input_shape == (3, 64, 64)


def test_image_settings_are_checked_and_grayscale_among_colour_is_read_as_colour(tmp_path):
    for bad in ("64", "64,0", "a,b", "64,64,3"):
        with pytest.raises(ValueError, match=r"image-size must be H,W \(whole pixels >= 1"):
            RunConfig.from_mapping({"image-size": bad})
    (tmp_path / "a").mkdir()
    Image.fromarray(np.full((8, 8, 3), 7, np.uint8)).save(tmp_path / "a" / "colour.png")
    Image.fromarray(np.full((8, 8), 9, np.uint8)).save(tmp_path / "a" / "grey.png")
    x, _ = folders.read_image_folder(tmp_path, 2)
    assert x.shape == (2, 3, 8, 8) and x[1].min() == x[1].max() == 9  # grey repeated on 3 channels
    x, _ = folders.read_image_folder(tmp_path, 2, folders.ImageOptions(size=(4, 6)))
    assert x.shape == (2, 3, 4, 6)


def test_simulate_takes_num_classes_from_the_class_folders_and_counts_the_skipped_files(images, tmp_path, capsys):
    from florist.cli import main

    args = ["simulate", "--runtime", "in-process", "--dataset", str(images), "--partition", "iid"]
    args += ["--num-clients", "2", "--rounds", "1", "--unseen-fraction", "0", "--results-dir", str(tmp_path / "out")]
    settings = 'skip-bad-images=true image-size="64,64" model="mobilenet_v2" min-train-nodes=1'
    assert main([*args, "--run-config", settings]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["config"]["num-classes"] == 3  # not given: one class per folder
    assert sum(c.get("skipped_images", 0) for c in results["clients"]) == 1  # the truncated file (48×48: resized)
    # predicting on the same folder decodes it as the run did: resized, its truncated file left out
    capsys.readouterr()
    predicted = ["predict", "--state-dir", str(tmp_path / "out" / "nodes"), "--node-key", "partition-0"]
    assert main([*predicted, "--data", str(images)]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"of {3 * PER_CLASS} samples)")  # 19 files - 1
    assert main([*args, "--run-config", f"{settings} num-classes=2"]) == 2  # given, and too few: one line
    assert re.fullmatch(r"florist: error: num-classes 2, but dataset .* names 3 classes .*\n", capsys.readouterr().err)


def test_a_box_checks_its_folder_with_its_own_image_settings(node_folder):
    from florist.deploy.join import check_locally

    where = ("127.0.0.1:9092", node_folder, 3, None, None, None, True)
    with pytest.raises(ValueError, match=r"train/a/0\.png: cannot be read as an image"):
        check_locally(*where)
    own = folders.ImageOptions(size=(64, 64), skip_bad=True)
    assert check_locally(*where, own).input_shape == (3, 64, 64)
