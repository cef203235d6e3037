"""`florist export-partition`'s data folder: one partition of a simulated scenario, written as
the folder a box joins a federation with (`florist join --data-dir`), so that a first deployment
can use data whose results the simulation already showed."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from florist.common import scenarios
from florist.common.data import ClientData
from florist.config import RunConfig


def export_partition(
    values: Mapping[str, Any], partition_id: int, num_partitions: int, out: Path, unlabeled: bool
) -> ClientData:
    """Partition `partition_id` of `num_partitions` of the scenario `values` name, written to
    `out` as train.npz (train + validation: a node carves its validation split itself) and
    test.npz, arrays x and y (x only when `unlabeled`); returns the partition."""
    data = scenarios.client_data(partition_id, num_partitions, RunConfig.from_mapping(values))
    out.mkdir(parents=True, exist_ok=True)
    train = {"x": np.concatenate([data.x_train, data.x_val]), "y": np.concatenate([data.y_train, data.y_val])}
    test = {"x": data.x_test, "y": data.y_test}
    for name, arrays in (("train", train), ("test", test)):
        np.savez(out / f"{name}.npz", **{k: v for k, v in arrays.items() if k == "x" or not unlabeled})
    return data
