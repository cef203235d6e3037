"""`florist export-partition` writes a simulated client's partition as the folder `florist join`
reads: the same samples, train + validation together (a node carves its validation split)."""

import numpy as np
import pytest

from florist.cli import main
from florist.common import folders, scenarios
from florist.config import RunConfig


@pytest.mark.parametrize("dataset", ["digits", "mnist5k"])
def test_an_exported_partition_is_the_simulated_clients_data_as_join_reads_it(tmp_path, dataset, capsys):
    args = ["--partition-id", "3", "--num-partitions", "8", "--dataset", dataset, "--partition", "dirichlet:0.5"]
    assert main(["export-partition", "--out", str(tmp_path / "box"), *args, "--seed", "4"]) == 0
    assert "florist join --data-dir" in capsys.readouterr().out
    cfg = RunConfig.from_mapping({"dataset": dataset, "partition": "dirichlet:0.5", "seed": 4})
    simulated = scenarios.client_data(3, 8, cfg)
    read = folders.folder_client(tmp_path / "box", 10, seed=0, val_fraction=cfg.val_fraction)
    np.testing.assert_array_equal(read.x_test, simulated.x_test)
    np.testing.assert_array_equal(read.y_test, simulated.y_test)
    assert read.x_train.dtype == simulated.x_train.dtype
    for split in ("x", "y"):  # train + val, as sets of rows
        ours = np.concatenate([getattr(read, f"{split}_train"), getattr(read, f"{split}_val")])
        theirs = np.concatenate([getattr(simulated, f"{split}_train"), getattr(simulated, f"{split}_val")])
        assert sorted(map(bytes, ours.reshape(len(ours), -1))) == sorted(map(bytes, theirs.reshape(len(theirs), -1)))


def test_an_unlabeled_export_has_no_labels(tmp_path):
    args = ["--out", str(tmp_path), "--partition-id", "0", "--num-partitions", "4", "--unlabeled"]
    assert main(["export-partition", *args]) == 0
    read = folders.folder_client(tmp_path, 10, seed=0, val_fraction=0.2)
    assert read.y_train is None and read.y_test is None and len(read.x_train) > 0
