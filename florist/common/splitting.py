"""A node's decoded folder (`folders.decode_folder`) split into train, validation and test in
memory, so that the decoded data are cached once whatever seed and fractions a run sends."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from florist.common.data import ClientData, split_indices, val_split


def split_client(
    where: Path, whole: ClientData, num_classes: int, seed: int, val_fraction: float, test_fraction: float
) -> ClientData:
    """`whole` (every training sample in `x_train`; the folder's own test set in `x_test`, or
    None) split by `seed`: with a test set, validation carved out of the training samples;
    without one, validation and test both out of them. `where`: the training samples' file or
    folder, which errors name."""
    x, y = whole.x_train, whole.y_train
    skipped = {"skipped_images": whole.skipped_images, "skipped_files": whole.skipped_files}
    if whole.x_test is not None:
        return _carve(where, x, y, whole.x_test, whole.y_test, num_classes, seed, val_fraction, skipped)
    if len(x) < 3:
        raise ValueError(f"{where}: need at least 3 images (train, validation and test), got {len(x)}")
    train, val, test = split_indices(len(x), val_fraction, test_fraction, seed)
    return ClientData(*_take(x, y, train), *_take(x, y, val), *_take(x, y, test), num_classes, **skipped)


def _carve(
    where: Path,
    x_train: np.ndarray,
    y_train: np.ndarray | None,
    x_test: np.ndarray,
    y_test: np.ndarray | None,
    num_classes: int,
    seed: int,
    val_fraction: float,
    skipped: dict | None = None,
) -> ClientData:
    """A node's data whose test set is its own: validation carved out of the training set."""
    if x_test.shape[1:] != x_train.shape[1:]:
        raise ValueError(
            f"{where.parent}: test samples have shape {x_test.shape[1:]} but train samples {x_train.shape[1:]}"
        )
    if (y_train is None) != (y_test is None):
        raise ValueError(f"{where.parent}: train and test must both be labelled or both unlabeled")
    if len(x_train) < 2:
        raise ValueError(f"{where}: need at least 2 training samples, got {len(x_train)}")
    train, val = val_split(len(x_train), val_fraction, seed)
    return ClientData(
        *_take(x_train, y_train, train),
        *_take(x_train, y_train, val),
        x_test,
        y_test,
        num_classes,
        **(skipped or {}),
    )


def _take(x: np.ndarray, y: np.ndarray | None, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    return x[idx], None if y is None else y[idx]
