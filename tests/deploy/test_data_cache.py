"""A local-folder dataset between real processes: each SuperNode decodes its partition once
(its first task, the info request before round 1), caches it on disk and afterwards only
memory-maps it, so every later exchange's `data_seconds_max` is small; and the cache changes
nothing learnt: the run's per-client accuracies equal those of the same run in-process, which
decodes into a cache of its own (one torch thread per client in both).

Every process is started by the test's LocalFederation and stopped by PID; every wait is bounded.
"""

import re

import numpy as np
import pytest
from datasets import ClassLabel, Dataset, Features, Image
from processes import RUN, submit

from florist.common import data as data_lib
from florist.config import RunConfig
from florist.deploy.federation import LocalFederation
from florist.runners.inprocess import run_in_process

NODES, ROUNDS = 3, 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """400 digits as 8×8 grayscale PNGs with a label, in one parquet file."""
    x, y = data_lib.load_digits()
    images = [(im[0] * 255).astype(np.uint8) for im in x[:400]]
    features = Features({"image": Image(), "label": ClassLabel(num_classes=10)})
    path = tmp_path_factory.mktemp("folder")
    Dataset.from_dict({"image": images, "label": y[:400].tolist()}, features=features).to_parquet(
        str(path / "train.parquet")
    )
    return path


def test_nodes_decode_a_folder_dataset_once_and_learn_as_in_process(folder, tmp_path, monkeypatch):
    configs = [
        {"partition-id": i, "num-partitions": NODES, "state-dir": str(tmp_path / "state"), "torch-threads": 1}
        for i in range(NODES)
    ]
    values = {"dataset": str(folder), "num-server-rounds": ROUNDS}
    with LocalFederation(tmp_path / "fed", configs) as fed:
        results = submit(fed, tmp_path / "out", **values)
        logs = [(fed.logs / f"supernode-{i}.log").read_text() for i in range(NODES)]
    # Decoded once per node, by the first task (the info request, before round 1); then read from the cache.
    assert [len(re.findall(r"partition \d+: decoded (\d+) of \1 samples", log)) for log in logs] == [1] * NODES
    assert results["complete"] and len(results["rounds"]) == ROUNDS and not results["failures"]
    data_seconds = [[e["data_seconds_max"] for e in r["exchanges"]] for r in results["rounds"]]
    print("data_seconds_max per round:", data_seconds)
    # Memory-mapped from the cache: ≤ 0.1 s here; a decode in a task's fresh process, `datasets` imported, 4.5-5 s
    # (the bound leaves room for a loaded machine).
    assert all(s < 2.0 for later in data_seconds[1:] for s in later), data_seconds
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # decoded afresh, not read from the nodes' cache
    cfg = RunConfig.from_mapping(RUN | values | {"min-nodes": NODES, "results-dir": str(tmp_path / "inprocess")})
    alone = run_in_process(cfg, NODES)
    accuracies = lambda r: [(c["client"], c["accuracy"]) for c in r["clients"]]  # noqa: E731
    assert accuracies(results) == accuracies(alone), (accuracies(results), accuracies(alone))
