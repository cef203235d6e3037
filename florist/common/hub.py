"""Datasets users already have: a Hugging Face dataset id (`uoft-cs/cifar10`, `ylecun/mnist`,
`flwrlabs/femnist`) or a local folder `datasets.load_dataset` reads (parquet, csv, json, an
image folder), partitioned by flwr-datasets' `FederatedDataset`.

The `train` split is partitioned (`iid`, `dirichlet:ALPHA`, `pathological:K` over the labels,
or `natural:COLUMN`, one client per value of COLUMN, e.g. FEMNIST's `writer_id`); each client
then splits its partition into train / validation / test as the embedded digits do. Images
become uint8 C×H×W (grayscale keeps one channel; a batch becomes floats in [0, 1] when it is
trained on), other numeric columns a float32 feature vector. A partition is decoded once per
machine and kept on disk (`common/datacache.py`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from florist.common import data as data_lib
from florist.common import datacache, folders

log = logging.getLogger(__name__)
DECODE_CHUNK = 1000  # rows decoded at once: bounds the PIL images alive and paces progress

LABEL_NAMES = ("label", "labels", "character", "fine_label", "y")
IMAGE_NAMES = ("image", "img", "pixel_values", "x")


@functools.lru_cache(maxsize=2)
def federated(spec: str, partition: str, num_partitions: int, seed: int, label_column: str):
    """flwr-datasets' FederatedDataset over `spec`'s train split, partitioned by `partition`."""
    import datasets
    from flwr_datasets import FederatedDataset
    from flwr_datasets.partitioner import NaturalIdPartitioner

    datasets.disable_progress_bars()  # florist shows its own: one bar in simulate, lines in a node's log

    kind, _, column = partition.partition(":")
    if kind == "natural":
        partitioner = NaturalIdPartitioner(partition_by=column)
    else:
        partitioner = data_lib.make_partitioner(partition, num_partitions, seed, partition_by=label_column or "label")
    source = str(Path(spec).expanduser()) if Path(spec).expanduser().exists() else spec
    try:
        return FederatedDataset(dataset=source, partitioners={"train": partitioner}, shuffle=True, seed=seed)
    except Exception as err:
        raise ValueError(
            f"dataset {spec!r} cannot be loaded ({type(err).__name__}: {err}); give a Hugging Face "
            "dataset id or a local folder that datasets.load_dataset reads"
        ) from None


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


def to_arrays(
    rows,
    image: str,
    label: str,
    where: str,
    options: folders.ImageOptions,
    report: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of a `datasets.Dataset`: images as uint8 C×H×W (grayscale keeps one channel)
    decoded by `folders.ImageDecoder` with `options` (a bad file named by its path, or skipped
    and counted), numbers as float32; decoded `DECODE_CHUNK` rows at a time, `report(rows
    done)` after each."""
    import datasets

    y = np.asarray(rows[label], dtype=np.int64)
    if not isinstance(rows.features[image], datasets.Image):
        x = np.asarray(rows[image], dtype=np.float32)
        if report:
            report(len(rows))
        return x, y
    rows = rows.cast_column(image, datasets.Image(decode=False))  # the files' paths, to name a bad one
    decoder = folders.ImageDecoder(where, options)
    for start in range(0, len(rows), DECODE_CHUNK):
        for index, value in enumerate(rows[start : start + DECODE_CHUNK][image], start):
            decoder.add(index, *_opener(value, f"{where}, row {index}"))
        if report:
            report(min(start + DECODE_CHUNK, len(rows)))
    x, kept = decoder.stack()
    return x, y[kept]


def _opener(value: dict, row: str) -> tuple[str, Callable]:
    """(name, open) of an undecoded `datasets.Image` value: a file's path, or bytes stored in
    the dataset (named by row, and by the file name they came from when the dataset kept it)."""
    import io

    from PIL import Image

    path, data = (value or {}).get("path"), (value or {}).get("bytes")
    if path is None and data is None:  # an empty cell: a bad "file" like any other, named by its row

        def missing():
            raise ValueError("no image in this row")

        return row, missing
    if data is None:
        return str(path), lambda: Image.open(path)
    return (f"{row} ({path})" if path else row), lambda: Image.open(io.BytesIO(data))


def class_count(cfg, num_partitions: int) -> int | None:
    """How many classes the dataset's label column names (an image folder: one per class
    sub-folder), None when it is a plain integer column; what `num-classes` is when not given."""
    from datasets import ClassLabel

    fds = federated(cfg.dataset, cfg.partition, num_partitions, cfg.seed, cfg.label_column)
    features = fds.load_split("train").features
    label = features[columns(features, cfg.image_column, cfg.label_column)[1]]
    return label.num_classes if isinstance(label, ClassLabel) else None


def hub_client(
    partition_id: int, num_partitions: int, cfg, report: Callable[[int, int], None] | None = None
) -> data_lib.ClientData:
    """Client `partition_id`'s partition of `cfg.dataset`, split like the embedded digits and
    checked like a node's own folder; decoded once per machine (`common/datacache.py`), keyed by
    the dataset's id or the folder's file listing and everything the partition depends on.
    `report(done, total)` follows the decoding when it happens; a node logs it instead."""
    source = Path(cfg.dataset).expanduser()
    local = source.is_dir()
    origin = (
        {"folder": str(source.resolve()), "files": datacache.folder_fingerprint(source)}
        if local
        else {"hub": cfg.dataset}
    )
    key = origin | {
        "partition": cfg.partition,
        "num-partitions": num_partitions,
        "partition-id": partition_id,
        "seed": cfg.seed,
        "image-column": cfg.image_column,
        "label-column": cfg.label_column,
        "val-fraction": cfg.val_fraction,
        "test-fraction": cfg.test_fraction,
        "num-classes": cfg.num_classes,
        **folders.ImageOptions.of(cfg).key(),
    }
    report = report or _logger(cfg.dataset, partition_id)
    return datacache.cached(key, lambda: _decode(partition_id, num_partitions, cfg, report))


def _logger(dataset: str, partition_id: int) -> Callable[[int, int], None]:
    """A `report` for logs: a line at the start, then about every 10 %."""
    last = -1

    def report(done: int, total: int) -> None:
        nonlocal last
        if done * 10 // max(total, 1) > last:
            last = done * 10 // max(total, 1)
            log.info("dataset %r, partition %d: decoded %d of %d samples", dataset, partition_id, done, total)

    return report


def _decode(partition_id: int, num_partitions: int, cfg, report: Callable[[int, int], None]) -> data_lib.ClientData:
    fds = federated(cfg.dataset, cfg.partition, num_partitions, cfg.seed, cfg.label_column)
    try:
        rows = fds.load_partition(partition_id, "train")
    except (ValueError, KeyError) as err:
        raise ValueError(
            f"dataset {cfg.dataset!r}: partition {partition_id} of {cfg.partition!r} cannot be loaded ({err})"
        ) from None
    image, label = columns(rows.features, cfg.image_column, cfg.label_column)
    where = f"dataset {cfg.dataset!r}, partition {partition_id}"
    options = folders.ImageOptions.of(cfg)
    x, y = to_arrays(rows, image, label, where, options, lambda done: report(done, len(rows)))
    skipped = len(rows) - len(x)  # bad image files left out (`skip-bad-images`)
    x, y = folders.check_arrays(where, x, y, cfg.num_classes)
    train, val, test = data_lib.split_indices(
        len(x), cfg.val_fraction, cfg.test_fraction, cfg.seed * 100_003 + partition_id
    )
    splits = (x[train], y[train], x[val], y[val], x[test], y[test])
    return data_lib.ClientData(*splits, cfg.num_classes, skipped_images=skipped)
