"""report.md's data section (issue 54): where the data came from, its classes and image size,
and the bad image files each client left out."""

from florist.server.report import markdown

CONFIG = {"partition": "iid", "num-classes": 3, "model": "cnn", "seed": 1, "unseen-fraction": 0.0}
EMPTY = {"num_clients": 0, "mean_accuracy": None, "bottom_decile_accuracy": None}


def _results(config, skipped):
    clients = [
        {"client": f"partition-{i}", "seen": True, "num_train": 10, "num_test": 4, "skipped_images": n}
        for i, n in enumerate(skipped)
    ]
    return {
        "strategy": "fedavg",
        "clients": clients,
        "config": CONFIG | config,
        "summary": {"seen": EMPTY, "unseen": EMPTY},
        "rounds": [],
    }


def test_the_report_says_what_data_the_clients_read_and_what_they_left_out():
    report = markdown(_results({"dataset": "/data/photos", "image-size": "64,64"}, [2, 0]))
    section = report.split("## Data\n\n", 1)[1].split("\n\n## ", 1)[0]
    assert (
        "Source `/data/photos`, 3 classes, images resized to 64,64; 2 clients hold 20 training and 8 test samples."
        in section
    )
    assert "- partition-0: 2 files" in section and "partition-1" not in section


def test_a_run_that_left_nothing_out_says_so():
    assert "No image file was left out." in markdown(_results({}, [0]))


def test_the_report_names_the_classes_of_the_runs_dataset(tmp_path):
    from florist.config import RunConfig
    from florist.server.results import Results

    for name in ("ant", "bee"):
        (tmp_path / "insects" / "train" / name).mkdir(parents=True)
    values = {"dataset": str(tmp_path / "insects"), "num-classes": 3, "results-dir": str(tmp_path / "run")}
    names = Results(RunConfig.from_mapping(values)).to_json()["class_names"]
    assert names == ["ant", "bee", "2"]  # a class no folder holds: its number
    section = markdown(_results({}, [0]) | {"class_names": names}).split("## Data\n\n", 1)[1]
    assert "Classes: 0 `ant`, 1 `bee`, 2 `2`." in section
    assert "Classes:" not in markdown(_results({}, [0]))  # data that names none (an .npz, synthetic): no line
    digits = Results(RunConfig.from_mapping({"results-dir": str(tmp_path / "run")})).to_json()["class_names"]
    assert digits == [str(c) for c in range(10)]


def _folder(root, classes, bad=()):
    """A node's own folder: train/ and test/ of 8×8 RGB PNGs, 6 per class, `bad` files cut short."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(len(classes))
    for split in ("train", "test"):
        for name in classes:
            (root / split / name).mkdir(parents=True)
            for i in range(6):
                Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / split / name / f"{i}.png")
    for name in bad:
        (root / name).write_bytes(b"not an image")
    return root


def test_nodes_reading_their_own_folders_are_reported_with_their_own_classes_and_bad_files(tmp_path):
    """Each node reads its own `data-dir` (as `florist join` boxes do): the server's run names no
    folder, so only what each node says at discovery can tell the report their classes and bad files."""
    import json

    from florist.apps.client import app
    from florist.apps.server import run
    from florist.common.flower_internals import server_identity
    from florist.config import RunConfig
    from florist.runners.inprocess import InProcessGrid

    bad = [f"train/cat/cut{i}.png" for i in range(25)]  # more than a reply names
    own = [_folder(tmp_path / "bees", ["ant", "bee"]), _folder(tmp_path / "pets", ["cat", "dog", "eel"], bad)]
    nodes = [{"data-dir": str(f), "trusted-server": True, "skip-bad-images": True} for f in own]
    values = {"num-classes": 3, "num-server-rounds": 1, "model": "mlp", "results-dir": str(tmp_path / "run")}
    cfg = RunConfig.from_mapping(values | {"min-train-nodes": 1})
    grid = InProcessGrid(app, nodes)
    with server_identity(grid.run_id):
        run(grid, cfg, None, grid.run_id)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [(g["source"], g["class_names"]) for g in sorted(results["data"], key=lambda g: g["source"])] == [
        ("folder bees", ["ant", "bee", "2"]),
        ("folder pets", ["cat", "dog", "eel"]),
    ]
    assert "class_names" not in results  # the nodes differ: not the default dataset's digits
    section = (tmp_path / "run" / "report.md").read_text().split("## Data\n\n", 1)[1]
    assert "`folder bees`, inputs 3×8×8; Classes: 0 `ant`, 1 `bee`, 2 `2`:" in section
    assert "`folder pets`, inputs 3×8×8; Classes: 0 `cat`, 1 `dog`, 2 `eel`:" in section
    assert "digits" not in section and str(tmp_path) not in section  # a node's path stays its own
    pets = next(c for c in results["clients"] if c.get("skipped_images"))
    assert len(pets["skipped_files"]) == 20 and set(pets["skipped_files"]) <= set(bad)
    assert f"- {pets['client']}: 25 files: `{pets['skipped_files'][0]}`, " in section and ", and 5 more" in section


def test_under_dp_a_node_names_no_bad_file_to_the_server(tmp_path):
    """A file's name can tell of the record it held: under any dp only the count leaves the node."""
    from types import SimpleNamespace

    from florist.client.messages import said
    from florist.common import protocol

    bad = tuple(str(tmp_path / "train" / "a" / f"{i}.png") for i in range(3))
    for dp, named in (("none", ["train/a/0.png", "train/a/1.png", "train/a/2.png"]), ("record", None)):
        node = SimpleNamespace(
            cfg=SimpleNamespace(dataset="digits", num_classes=2, dp=dp),
            node_config={"data-dir": str(tmp_path)},
            data=SimpleNamespace(skipped_files=bad),
        )
        assert said(node).get(protocol.SKIPPED_FILES) == named
        assert said(node)[protocol.DATA_SOURCE] == f"folder {tmp_path.name}"
