"""A dataset users already have, through flwr-datasets: a local folder that
`datasets.load_dataset` reads (parquet here; a Hugging Face id goes the same way with a
connection), images converted with torchvision, partitioned by label or by a natural id."""

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from datasets import ClassLabel, Dataset, Features, Image, Value

from florist.common import data as data_lib
from florist.common import scenarios
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process

WRITERS = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """400 digits as 8×8 grayscale PNGs with a label and the id of one of 4 'writers'."""
    x, y = data_lib.load_digits()
    images = [(im[0] * 255).astype(np.uint8) for im in x[:400]]
    writers = [f"w{i % WRITERS}" for i in range(400)]
    features = Features({"image": Image(), "label": ClassLabel(num_classes=10), "writer_id": Value("string")})
    path = tmp_path_factory.mktemp("hub")
    Dataset.from_dict({"image": images, "label": y[:400].tolist(), "writer_id": writers}, features=features).to_parquet(
        str(path / "train.parquet")
    )
    return path


def test_a_folder_partitioned_by_writer_gives_each_client_its_writers_images(folder):
    cfg = RunConfig.from_mapping({"dataset": str(folder), "partition": "natural:writer_id"})
    clients = [scenarios.client_data(i, WRITERS, cfg) for i in range(WRITERS)]
    assert [len(c.x_train) + len(c.x_val) + len(c.x_test) for c in clients] == [100] * WRITERS
    assert all(c.input_shape == (1, 8, 8) and c.x_train.dtype == np.uint8 for c in clients)  # kept as stored
    digits = {((img * 255).astype(np.uint8).tobytes(), int(label)) for img, label in zip(*data_lib.load_digits())}
    as_bytes = lambda img: np.asarray(img).tobytes()  # noqa: E731
    for c in clients:  # every sample is a digit with its own label, through PNG and back
        assert all((as_bytes(img), int(label)) in digits for img, label in zip(c.x_test, c.y_test))


def test_a_run_on_a_folder_dataset_completes(folder, tmp_path):
    cfg = RunConfig.from_mapping(
        {
            "dataset": str(folder),
            "partition": "iid",
            "num-server-rounds": 2,
            "min-nodes": 4,
            "results-dir": str(tmp_path),
        }
    )
    results = run_in_process(cfg, 4)
    assert results["complete"] and len(results["clients"]) == 4 and not results["failures"]


def test_dataset_mistakes_are_named(folder):
    with pytest.raises(ValueError, match="label-column to the label column"):
        scenarios.client_data(
            0, 2, RunConfig.from_mapping({"dataset": str(folder), "partition": "iid", "label-column": "digit"})
        )
    with pytest.raises(ValueError, match="needs a Hugging Face dataset or folder with that column"):
        RunConfig.from_mapping({"partition": "natural:writer_id"})


def _decoded(monkeypatch, cfg, partition_id=0, num=WRITERS):
    """(client data, images decoded to get it) in a process that remembers nothing yet, as
    a fresh deployment process would be. Decoded: what the decoder adds, not the headers
    read once per dataset to settle its image size."""
    from florist.common import datacache, folders, hub

    opened, real_add = [], folders.ImageDecoder.add
    monkeypatch.setattr(folders.ImageDecoder, "add", lambda *a: opened.append(1) or real_add(*a))
    monkeypatch.setattr(datacache, "_MEMORY", {})
    hub.federated.cache_clear()
    client = scenarios.client_data(partition_id, num, cfg)
    monkeypatch.undo()
    return client, len(opened)


def test_a_partition_is_decoded_once_and_again_only_when_its_folder_changes(folder, tmp_path, monkeypatch, caplog):
    import shutil

    own = tmp_path / "dataset"
    shutil.copytree(folder, own)
    cfg = RunConfig.from_mapping({"dataset": str(own), "partition": "iid", "seed": 5})
    first, decodes = _decoded(monkeypatch, cfg)
    assert decodes == len(first.x_train) + len(first.x_val) + len(first.x_test) == 100
    again, decodes = _decoded(monkeypatch, cfg)
    assert decodes == 0 and np.array_equal(again.x_train, first.x_train) and np.array_equal(again.y_test, first.y_test)
    assert isinstance(again.x_train, np.memmap) and again.x_train.dtype == np.uint8

    x_file, expected = Path(first.x_train.filename), np.array(first.x_train)  # this entry's x_train, truncated
    with open(x_file, "r+b") as f:
        f.truncate(x_file.stat().st_size - 64)
    with caplog.at_level("WARNING"):
        rebuilt, decodes = _decoded(monkeypatch, cfg)
    assert decodes == 100 and np.array_equal(rebuilt.x_train, expected) and "damaged" in caplog.text

    table = pq.read_table(own / "train.parquet")  # the folder changes: 40 fewer rows
    pq.write_table(table.slice(0, 360), own / "train.parquet")
    changed, decodes = _decoded(monkeypatch, cfg)
    assert decodes == 90 and len(changed.x_train) + len(changed.x_val) + len(changed.x_test) == 90
