"""Datasets users already have: a Hugging Face dataset id (`uoft-cs/cifar10`, `ylecun/mnist`,
`flwrlabs/femnist`) or a local folder `datasets.load_dataset` reads (parquet, csv, json, an
image folder), partitioned by flwr-datasets' `FederatedDataset`.

The `train` split is partitioned (`iid`, `dirichlet:ALPHA`, `pathological:K` over the labels,
or `natural:COLUMN`, one client per value of COLUMN, e.g. FEMNIST's `writer_id`); each client
then splits its partition into train / validation / test as the embedded digits do. Images
become float C×H×W in [0, 1] (torchvision's `to_tensor`; grayscale keeps one channel), other
numeric columns a feature vector.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from florist.common import data as data_lib

LABEL_NAMES = ("label", "labels", "character", "fine_label", "y")
IMAGE_NAMES = ("image", "img", "pixel_values", "x")


def is_hub(spec: str) -> bool:
    """Whether `dataset` names a Hugging Face dataset or a local folder (not a built-in)."""
    return spec not in ("digits",) and not spec.startswith("synthetic:")


@functools.lru_cache(maxsize=2)
def federated(spec: str, partition: str, num_partitions: int, seed: int, label_column: str):
    """flwr-datasets' FederatedDataset over `spec`'s train split, partitioned by `partition`."""
    from flwr_datasets import FederatedDataset
    from flwr_datasets.partitioner import NaturalIdPartitioner

    kind, _, column = partition.partition(":")
    if kind == "natural":
        partitioner = NaturalIdPartitioner(partition_by=column)
    else:
        partitioner = data_lib.make_partitioner(partition, num_partitions, seed, partition_by=label_column or "label")
    source = str(Path(spec).expanduser()) if Path(spec).expanduser().exists() else spec
    try:
        return FederatedDataset(dataset=source, partitioners={"train": partitioner}, shuffle=True, seed=seed)
    except Exception as err:  # noqa: BLE001 (datasets raises many kinds; each means the same to a user)
        raise ValueError(f"dataset {spec!r} cannot be loaded ({type(err).__name__}: {err}); give a Hugging Face "
                         "dataset id or a local folder that datasets.load_dataset reads") from None  # fmt: skip


def columns(features: dict[str, Any], image_column: str, label_column: str) -> tuple[str, str]:
    """(image/feature column, label column): the named ones, else found by type and name."""
    from datasets import ClassLabel, Image

    label = label_column or next((n for n, f in features.items() if isinstance(f, ClassLabel)), None)
    label = label or next((n for n in LABEL_NAMES if n in features), None)
    image = image_column or next((n for n, f in features.items() if isinstance(f, Image)), None)
    image = image or next((n for n in IMAGE_NAMES if n in features), None)
    for role, name in (("label-column", label), ("image-column", image)):
        if not name or name not in features:
            raise ValueError(f"dataset columns are {sorted(features)}: set {role} to the {role.split('-')[0]} column")
    return image, label


def to_arrays(rows, image: str, label: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of a `datasets.Dataset`: images through `to_tensor`, numbers as float32."""
    from torchvision.transforms.functional import pil_to_tensor

    values = rows[image]
    if hasattr(values[0], "mode"):  # PIL images
        x = np.stack([pil_to_tensor(v if v.mode in ("L", "RGB") else v.convert("RGB")).numpy() for v in values])
        x = x.astype(np.float32) / 255.0
    else:
        x = np.asarray(values, dtype=np.float32)
    return x, np.asarray(rows[label], dtype=np.int64)


def hub_client(partition_id: int, num_partitions: int, cfg) -> data_lib.ClientData:
    """Client `partition_id`'s partition of `cfg.dataset`, split like the embedded digits and
    checked like a node's own folder."""
    fds = federated(cfg.dataset, cfg.partition, num_partitions, cfg.seed, cfg.label_column)
    try:
        rows = fds.load_partition(partition_id, "train")
    except (ValueError, KeyError) as err:
        raise ValueError(f"dataset {cfg.dataset!r}: partition {partition_id} of {cfg.partition!r} cannot be loaded "
                         f"({err})") from None  # fmt: skip
    image, label = columns(rows.features, cfg.image_column, cfg.label_column)
    x, y = to_arrays(rows, image, label)
    x, y = data_lib.check_arrays(f"dataset {cfg.dataset!r}, partition {partition_id}", x, y, cfg.num_classes)
    train, val, test = data_lib.split_indices(len(x), cfg.val_fraction, cfg.test_fraction, cfg.seed * 100_003 + partition_id)
    return data_lib.ClientData(x[train], y[train], x[val], y[val], x[test], y[test], cfg.num_classes)
