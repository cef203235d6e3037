"""A dataset users already have, through flwr-datasets: a local folder that
`datasets.load_dataset` reads (parquet here; a Hugging Face id goes the same way with a
connection), images converted with torchvision, partitioned by label or by a natural id."""

import numpy as np
import pytest
from datasets import ClassLabel, Dataset, Features, Image, Value

from florist.common import data as data_lib
from florist.common import scenarios
from florist.common.config import RunConfig
from florist.server.inprocess import run_in_process

WRITERS = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """400 digits as 8×8 grayscale PNGs with a label and the id of one of 4 'writers'."""
    x, y = data_lib.load_digits()
    images = [(im[0] * 255).astype(np.uint8) for im in x[:400]]
    writers = [f"w{i % WRITERS}" for i in range(400)]
    features = Features({"image": Image(), "label": ClassLabel(num_classes=10), "writer_id": Value("string")})
    path = tmp_path_factory.mktemp("hub")
    Dataset.from_dict({"image": images, "label": y[:400].tolist(), "writer_id": writers}, features=features
                      ).to_parquet(str(path / "train.parquet"))  # fmt: skip
    return path


def test_a_folder_partitioned_by_writer_gives_each_client_its_writers_images(folder):
    cfg = RunConfig.from_mapping({"dataset": str(folder), "partition": "natural:writer_id"})
    clients = [scenarios.client_data(i, WRITERS, cfg) for i in range(WRITERS)]
    assert [len(c.x_train) + len(c.x_val) + len(c.x_test) for c in clients] == [100] * WRITERS
    assert all(c.input_shape == (1, 8, 8) and c.x_train.dtype == np.float32 for c in clients)
    as_bytes = lambda img: np.round(img * 255).astype(np.uint8).tobytes()  # noqa: E731
    digits = {(as_bytes((img * 255).astype(np.uint8) / 255), int(label)) for img, label in zip(*data_lib.load_digits())}
    for c in clients:  # every sample is a digit with its own label, through PNG and to_tensor
        assert all((as_bytes(img), int(label)) in digits for img, label in zip(c.x_test, c.y_test))


def test_a_run_on_a_folder_dataset_completes(folder, tmp_path):
    cfg = RunConfig.from_mapping({"dataset": str(folder), "partition": "iid", "num-server-rounds": 2, "min-nodes": 4,
                                  "results-dir": str(tmp_path)})  # fmt: skip
    results = run_in_process(cfg, 4)
    assert results["complete"] and len(results["clients"]) == 4 and not results["failures"]


def test_dataset_mistakes_are_named(folder):
    with pytest.raises(ValueError, match="label-column to the label column"):
        scenarios.client_data(0, 2, RunConfig.from_mapping({"dataset": str(folder), "partition": "iid",
                                                             "label-column": "digit"}))  # fmt: skip
    with pytest.raises(ValueError, match="needs a Hugging Face dataset or folder with that column"):
        RunConfig.from_mapping({"partition": "natural:writer_id"})
