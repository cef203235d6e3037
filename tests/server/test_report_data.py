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
