"""Datasets users already have: a Hugging Face dataset id (`uoft-cs/cifar10`, `ylecun/mnist`,
`flwrlabs/femnist`) or a local folder `datasets.load_dataset` reads (parquet, csv, json, an
image folder), partitioned by flwr-datasets' `FederatedDataset`.

The `train` split is partitioned (`iid`, `dirichlet:ALPHA`, `pathological:K` over the labels,
or `natural:COLUMN`, one client per value of COLUMN, e.g. FEMNIST's `writer_id`); each client
then splits its partition into train / validation / test as the embedded digits do. A local
folder with a `test` split (an image folder's `test/` beside `train/`) gives the clients their
test sets instead (`deal`: each client's in its own training classes' proportions), and each
client splits its partition into train / validation only. Images become uint8 C×H×W, every
one of a dataset to the same shape (`folders.survey`, kept per dataset); grayscale keeps one
channel, and a batch becomes floats in [0, 1] when it is trained on. Other numeric columns
become a float32 feature vector. A partition is decoded once per machine and kept on disk
(`common/datacache.py`).
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
from florist.common.badfiles import refuse_all

log = logging.getLogger(__name__)
DECODE_CHUNK = 1000  # rows decoded at once: bounds the PIL images alive and paces progress

LABEL_NAMES = ("label", "labels", "character", "fine_label", "y")
IMAGE_NAMES = ("image", "img", "pixel_values", "x")


@functools.lru_cache(maxsize=2)
def federated(spec: str, partition: str, num_partitions: int, seed: int, label_column: str, files: str = ""):
    """flwr-datasets' FederatedDataset over `spec`'s train split, partitioned by `partition`;
    `files`, a local folder's fingerprint, makes a changed folder a new one to this cache."""
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
    shape: tuple[int, int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(x, y, the bad files left out) of a `datasets.Dataset`: images as uint8 C×H×W (grayscale keeps one channel)
    decoded by `folders.ImageDecoder` with `options` to `shape` (the dataset's: `image_shape`;
    a bad file named by its path, or skipped and counted), numbers as float32; decoded
    `DECODE_CHUNK` rows at a time, `report(rows done)` after each."""
    import datasets

    y = np.asarray(rows[label], dtype=np.int64)
    if not isinstance(rows.features[image], datasets.Image):
        x = np.asarray(rows[image], dtype=np.float32)
        if report:
            report(len(rows))
        return x, y, []
    decoder = folders.ImageDecoder(where, options, shape)
    for index, (name, open_image) in enumerate(_openers(rows, image, where)):
        decoder.add(index, name, open_image)
        if report and (index + 1) % DECODE_CHUNK == 0 and index + 1 < len(rows):
            report(index + 1)
    if report:
        report(len(rows))
    x, kept = decoder.stack()
    return x, y[kept], decoder.skipped


def _openers(rows, image: str, where: str):
    """(name, open) of each row's image, read `DECODE_CHUNK` rows at a time undecoded (the
    files' paths, to name a bad one)."""
    import datasets

    rows = rows.cast_column(image, datasets.Image(decode=False))
    for start in range(0, len(rows), DECODE_CHUNK):
        for index, value in enumerate(rows[start : start + DECODE_CHUNK][image], start):
            yield _opener(value, f"{where}, row {index}")


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

    fds = _federated(cfg, num_partitions, _origin(cfg.dataset))
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
    origin = _origin(cfg.dataset)
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
    return datacache.cached(key, lambda: _decode(partition_id, num_partitions, cfg, origin, report))


def _origin(dataset: str) -> dict[str, str]:
    """What a dataset's data comes from: a hub id, or a local folder and its file listing."""
    source = Path(dataset).expanduser()
    if source.is_dir():
        return {"folder": str(source.resolve()), "files": datacache.folder_fingerprint(source)}
    return {"hub": dataset}


def _federated(cfg, num_partitions: int, origin: dict[str, str]):
    """`federated` for a run config: a local folder changed since it was loaded is loaded again."""
    return federated(cfg.dataset, cfg.partition, num_partitions, cfg.seed, cfg.label_column, origin.get("files", ""))


def _logger(dataset: str, partition_id: int) -> Callable[[int, int], None]:
    """A `report` for logs: a line at the start, then about every 10 %."""
    last = -1

    def report(done: int, total: int) -> None:
        nonlocal last
        if done * 10 // max(total, 1) > last:
            last = done * 10 // max(total, 1)
            log.info("dataset %r, partition %d: decoded %d of %d samples", dataset, partition_id, done, total)

    return report


def _decode(
    partition_id: int, num_partitions: int, cfg, origin: dict, report: Callable[[int, int], None]
) -> data_lib.ClientData:
    fds = _federated(cfg, num_partitions, origin)
    try:
        rows = fds.load_partition(partition_id, "train")
    except (ValueError, KeyError) as err:
        raise ValueError(
            f"dataset {cfg.dataset!r}: partition {partition_id} of {cfg.partition!r} cannot be loaded ({err})"
        ) from None
    image, label = columns(rows.features, cfg.image_column, cfg.label_column)
    where, test_where = (f"dataset {cfg.dataset!r}, {split}partition {partition_id}" for split in ("", "test split, "))
    options = folders.ImageOptions.of(cfg)
    test = _test_split(fds, label, cfg.dataset) if "folder" in origin else None
    shape = image_shape(fds, test, image, origin, options)
    own_test = None if test is None else test.select(_own_test_rows(fds, test, label, partition_id, cfg, origin))
    total = len(rows) + (0 if own_test is None else len(own_test))
    decoders = [lambda: to_arrays(rows, image, label, where, options, lambda done: report(done, total), shape)]
    if own_test is not None:  # its bad files refused with the train split's, in one line
        progress = lambda n: report(len(rows) + n, total)  # noqa: E731
        decoders.append(lambda: to_arrays(own_test, image, label, test_where, options, progress, shape))
    (x, y, skipped), *tested = refuse_all(decoders)
    x, y = folders.check_arrays(where, x, y, cfg.num_classes)
    seed = cfg.seed * 100_003 + partition_id
    if not tested:
        train, val, held = data_lib.split_indices(len(x), cfg.val_fraction, cfg.test_fraction, seed)
        x_test, y_test = x[held], y[held]
    else:
        train, val = data_lib.val_split(len(x), cfg.val_fraction, seed)
        x_test, y_test, bad = tested[0]
        skipped += bad
        x_test, y_test = folders.check_arrays(test_where, x_test, y_test, cfg.num_classes)
    splits = (x[train], y[train], x[val], y[val], x_test, y_test)
    return data_lib.ClientData(*splits, cfg.num_classes, skipped_images=len(skipped), skipped_files=tuple(skipped))


def _test_split(fds, label: str, dataset: str):
    """A local folder's `test` split (an image folder's test/), None when it has none; its labels
    must mean what the train split's do (Hugging Face's imagefolder numbers the class folders of
    all splits together, so a class test/ lacks shifts no id)."""
    try:
        test = fds.load_split("test")
    except ValueError:  # no such split
        return None
    train = fds.load_split("train").features
    if label not in test.features or test.features[label] != train[label]:
        raise ValueError(
            f"dataset {dataset!r}: its test split's labels ({test.features.get(label)}) are not its train split's "
            f"({train[label]}); give both the same label column and classes, or remove the test split"
        )
    return test


def _own_test_rows(fds, test, label: str, partition_id: int, cfg, origin: dict) -> np.ndarray:
    """The rows of `test` client `partition_id` is tested on (`deal`), the same in every process;
    dealt once per machine (`datacache.remembered`), not once per client (each would read every
    partition's labels)."""
    num_partitions = fds.partitioners["train"].num_partitions

    def dealt() -> dict:
        trained = [np.asarray(fds.load_partition(i, "train")[label], dtype=np.int64) for i in range(num_partitions)]
        test_labels = np.asarray(test[label], dtype=np.int64)
        classes = 1 + max([int(test_labels.max(initial=0)), *(int(t.max(initial=0)) for t in trained)])
        held = np.stack([np.bincount(t, minlength=classes) for t in trained])
        parts = deal(test_labels, held, cfg.seed)
        return {"parts": [p.tolist() for p in parts], "classes": [np.flatnonzero(h).tolist() for h in held]}

    key = origin | {"deal": label, "partition": cfg.partition, "num-partitions": num_partitions, "seed": cfg.seed}
    found = datacache.remembered(key, dealt)
    mine = np.asarray(found["parts"][partition_id], dtype=np.int64)
    if partition_id == 0:  # said once per run
        used = sum(len(p) for p in found["parts"])
        log.info(
            "dataset %r: each client is tested on its share of the test split's %d images (%d of classes no client "
            "trains on left out), dealt in its training classes' proportions; test-fraction is not used",
            cfg.dataset,
            len(test),
            len(test) - used,
        )
    if not len(mine):
        raise ValueError(
            f"dataset {cfg.dataset!r}: its test split has no image of client {partition_id}'s classes "
            f"{found['classes'][partition_id]}; add test images of them, or remove the test split "
            "to test each client on a test-fraction of its own images"
        )
    return mine


def deal(test_labels: np.ndarray, held: np.ndarray, seed: int) -> list[np.ndarray]:
    """Each client's rows of a shared test set: for every class c, its test rows are dealt (seeded,
    without replacement) to the clients in proportion to `held[i, c]`, the images of c client i
    trains on. Largest-remainder rounding (exact, in integers; a tie goes to the lower client
    id), so every test image of a class some client holds is used once, and a client without
    c gets none of it. A class no client holds is left out of every test set."""
    rng = np.random.default_rng([seed, 0x7E57])
    parts: list[list[np.ndarray]] = [[] for _ in range(len(held))]
    for c in np.unique(test_labels):
        rows = rng.permutation(np.flatnonzero(test_labels == c))
        counts = held[:, c].astype(np.int64)
        if counts.sum() == 0:
            continue
        quota, remainder = np.divmod(len(rows) * counts, counts.sum())
        order = np.lexsort((np.arange(len(counts)), -remainder))  # largest remainder first, then the lower id
        quota[order[: len(rows) - quota.sum()]] += 1
        for i, (start, end) in enumerate(zip(np.cumsum(quota) - quota, np.cumsum(quota))):
            parts[i].append(rows[start:end])
    return [np.sort(np.concatenate(p)) if p else np.empty(0, dtype=np.int64) for p in parts]


def image_shape(fds, test, image: str, origin: dict, options: folders.ImageOptions) -> tuple[int, int, int] | None:
    """The C×H×W every image of a local folder (its train split, and the test split when used)
    is decoded to (`folders.decoded_shape`), so that every client's images agree whatever its
    partition holds; surveyed once per machine (`datacache.remembered`). None for a dataset of
    numbers, and for a hub dataset (whose images are of one size, and whose split may be
    800,000 images a node with one partition would otherwise read): each partition's own."""
    import datasets

    if "folder" not in origin:
        return None
    train = fds.load_split("train")
    if not isinstance(train.features[image], datasets.Image):
        return None
    splits = {"train": train} | ({} if test is None else {"test": test})
    key = origin | {"survey": image, "splits": list(splits)}
    found = datacache.remembered(
        key, lambda: folders.survey(o for name, rows in splits.items() for _, o in _openers(rows, image, name))
    )
    return folders.decoded_shape(found, options)
