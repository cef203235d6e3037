"""Federations where one global model is not enough, built here with no download: clusters
of clients whose labels are permuted (concept shift) or whose images are rotated (covariate
shift), on top of the `partition` label skew, and FedProx's Synthetic(α, β) clients.

`client_data` is what a node built from `partition-id` / `num-partitions` holds, whatever the
scenario; its `cluster` says which group of clients it belongs to (None without a shift).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np

from florist.common import data as data_lib

SHIFTS = "'none', 'relabel:K' or 'rotate:K' (K >= 1 clusters of clients)"
DATASETS = (
    "'digits', 'mnist5k', 'synthetic:ALPHA,BETA' (ALPHA, BETA >= 0), a Hugging Face dataset id "
    "(OWNER/NAME) or a local folder"
)
# A Hugging Face id: OWNER/NAME, neither part starting with "." or "-" ("./x", "../x" are paths).
HUB_ID = re.compile(r"[A-Za-z0-9_][\w.-]*/[A-Za-z0-9_][\w.-]*")
LOCAL_DATASET = "a local dataset is a folder of parquet/csv/json files or of one subfolder of images per class"
SYNTHETIC_FEATURES, SYNTHETIC_CLASSES = 60, 10
MAX_SYNTHETIC_SIZE = 5000  # FedProx's log-normal sizes have a heavy tail; a client holds at most this many


def parse_shift(text: str) -> tuple[str, int]:
    """(kind, K) of `none`, `relabel:K` or `rotate:K`; a ValueError naming the forms otherwise."""
    kind, colon, arg = text.partition(":")
    if kind == "none" and not colon:
        return kind, 1
    if kind in ("relabel", "rotate") and arg.isdigit() and int(arg) >= 1:
        return kind, int(arg)
    raise ValueError(f"shift {text!r} is not one of {SHIFTS}")


def parse_dataset(text: str) -> tuple[str, tuple[float, ...]]:
    """(kind, parameters) of an embedded dataset (kind `embedded`), `synthetic:ALPHA,BETA`, or
    `hub` for a dataset id or folder. An existing folder is local, and an OWNER/NAME that is
    no file or folder here is a hub id; any other text with a `/`, or starting with `~` or `.`,
    is a path, and saying that it is no folder beats listing every form."""
    kind, colon, arg = text.partition(":")
    if kind in data_lib.EMBEDDED_SHAPES and not colon:
        return "embedded", ()
    folder = Path(text).expanduser()
    if text and folder.exists():  # "": no folder, not "."
        if not folder.is_dir():
            raise ValueError(f"dataset {text!r}: not a folder ({LOCAL_DATASET})")
        return "hub", ()
    if HUB_ID.fullmatch(text):
        return "hub", ()
    try:
        alpha, beta = (float(v) for v in arg.split(","))
        if kind == "synthetic" and alpha >= 0 and beta >= 0:
            return kind, (alpha, beta)
    except ValueError:
        pass
    if "/" in text or text.startswith(("~", ".")):
        raise ValueError(f"dataset {text!r}: no such folder ({LOCAL_DATASET})")
    raise ValueError(f"dataset must be {DATASETS}, got {text!r}")


def input_shape(cfg, num_partitions: int) -> tuple[int, ...]:
    """The samples' shape under `cfg` (a Hugging Face dataset or folder: its first partition's).
    Where that partition holds bad image files, the others are decoded too before they are
    refused, so one refusal names those of the whole dataset."""
    kind = parse_dataset(cfg.dataset)[0]
    if kind == "hub":
        from florist.common.badfiles import BadImages

        try:
            return client_data(0, num_partitions, cfg).input_shape
        except BadImages as err:
            bad = list(err.bad)
            for pid in range(1, num_partitions):
                try:
                    client_data(pid, num_partitions, cfg)
                except BadImages as more:
                    bad += more.bad
            raise BadImages(bad) from None
    return (SYNTHETIC_FEATURES,) if kind == "synthetic" else data_lib.EMBEDDED_SHAPES[cfg.dataset]


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a run's data lies over its `num_partitions` clients, worked out once before the run
    (`runners/preflight.py`); the embedded partitions it builds are cached on disk, where the
    clients read them."""

    input_shape: tuple[int, ...]
    held_out: frozenset[int]  # the clients that never train
    labels: tuple[np.ndarray, ...] = ()  # each embedded partition's labels (empty for other datasets)


def layout(cfg, num_partitions: int) -> Layout:
    """The run's `Layout` (a ValueError when its embedded partitions cannot be built)."""
    held_out = data_lib.unseen_partitions(num_partitions, cfg.unseen_fraction, cfg.seed)
    if cfg.dataset not in data_lib.EMBEDDED_SHAPES:
        return Layout(input_shape(cfg, num_partitions), held_out)
    parts = data_lib.partition_indices(
        cfg.partition, num_partitions, cfg.seed, cfg.min_partition_size, cfg.public_size, cfg.dataset
    )
    labels = data_lib.load_embedded(cfg.dataset)[1]
    return Layout(data_lib.EMBEDDED_SHAPES[cfg.dataset], held_out, tuple(labels[p] for p in parts))


def cluster_of(partition_id: int, num_partitions: int, clusters: int, seed: int) -> int:
    """Client `partition_id`'s cluster: clients are dealt round-robin into `clusters` groups in
    a seeded order, so groups differ in size by at most one and do not follow partition ids."""
    order = np.random.default_rng([seed, 0xC1]).permutation(num_partitions)
    return int(np.flatnonzero(order == partition_id)[0] % clusters)


def label_permutation(cluster: int, num_classes: int, seed: int) -> np.ndarray:
    """Cluster `cluster`'s fixed permutation π of the labels: its clients see π(y) for y."""
    return np.random.default_rng([seed, 0x1AB, cluster]).permutation(num_classes)


def rotate(x: np.ndarray, degrees: float) -> np.ndarray:
    """N×C×H×W images rotated counter-clockwise; multiples of 90° on square images are exact."""
    if degrees % 90 == 0 and x.shape[-1] == x.shape[-2]:
        return np.ascontiguousarray(np.rot90(x, k=int(degrees // 90) % 4, axes=(-2, -1)))
    import torch
    from torchvision.transforms.functional import rotate as tv_rotate

    return tv_rotate(torch.from_numpy(x), degrees).numpy()


def shifted(data: data_lib.ClientData, shift: str, cluster: int, seed: int) -> data_lib.ClientData:
    """`data` as cluster `cluster` of `shift` sees it."""
    kind, clusters = parse_shift(shift)
    if kind == "relabel":
        pi = label_permutation(cluster, data.num_classes, seed)
        relabel = lambda y: None if y is None else pi[y]  # noqa: E731
        return dataclasses.replace(
            data, y_train=relabel(data.y_train), y_val=relabel(data.y_val), y_test=relabel(data.y_test), cluster=cluster
        )
    if kind == "rotate":
        if len(data.input_shape) != 3:
            raise ValueError(f"shift {shift!r} rotates images, but the samples have shape {data.input_shape}")
        angle = cluster * 360.0 / clusters
        return dataclasses.replace(
            data,
            x_train=rotate(data.x_train, angle),
            x_val=rotate(data.x_val, angle),
            x_test=rotate(data.x_test, angle),
            cluster=cluster,
        )
    return data


def synthetic_client(
    partition_id: int, alpha: float, beta: float, seed: int, val_fraction: float, test_fraction: float
) -> data_lib.ClientData:
    """Client `partition_id` of Synthetic(α, β) (Li et al., FedProx, MLSys 2020, as in its
    data generator): its own softmax model W, b ~ N(u, 1) with u ~ N(0, α²), its own feature
    mean v ~ N(B, 1) with B ~ N(0, β²), x ~ N(v, Σ) with Σ_jj = j^(−1.2), y = argmax(Wx + b);
    50 + LogNormal(4, 2) samples. β sets how far apart the clients' features are; α shifts every
    entry of a client's W and b alike, which moves all class scores together, so, as in
    FedProx's generator, it does not change which label wins."""
    rng = np.random.default_rng([seed, 0x5F, partition_id])
    size = min(50 + int(rng.lognormal(4, 2)), MAX_SYNTHETIC_SIZE)
    u, b_mean = rng.normal(0, alpha), rng.normal(0, beta)
    w = rng.normal(u, 1, (SYNTHETIC_FEATURES, SYNTHETIC_CLASSES))
    b = rng.normal(u, 1, SYNTHETIC_CLASSES)
    x = _synthetic_features(rng, b_mean, size)
    y = (x @ w + b).argmax(1).astype(np.int64)
    train, val, test = data_lib.split_indices(size, val_fraction, test_fraction, seed * 100_003 + partition_id)
    return data_lib.ClientData(x[train], y[train], x[val], y[val], x[test], y[test], SYNTHETIC_CLASSES)


def client_data(partition_id: int, num_partitions: int, cfg) -> data_lib.ClientData:
    """What node `partition_id` of `num_partitions` holds under run config `cfg`: the
    embedded digits partition or its Synthetic(α, β) client, seen through the run's shift.
    The one way from a run config to a client's data (nodes, the CLI, tests, benchmarks), so
    that none repeats `embedded_client`'s positional arguments and drifts from the others."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside [0, {num_partitions})")
    kind, params = parse_dataset(cfg.dataset)
    if kind == "synthetic":
        data = synthetic_client(partition_id, *params, cfg.seed, cfg.val_fraction, cfg.test_fraction)
    elif kind == "hub":
        from florist.common.hub import hub_client

        data = hub_client(partition_id, num_partitions, cfg)
    else:
        data = data_lib.embedded_client(
            partition_id,
            num_partitions,
            cfg.partition,
            cfg.seed,
            cfg.val_fraction,
            cfg.test_fraction,
            cfg.min_partition_size,
            public_size=cfg.public_size,
            dataset=cfg.dataset,
        )
    shift, clusters = parse_shift(cfg.shift)
    if shift == "none":
        return data
    return shifted(data, cfg.shift, cluster_of(partition_id, num_partitions, clusters, cfg.seed), cfg.seed)


def public_set(cfg) -> np.ndarray:
    """The default public unlabeled set P: digits no client owns, or for Synthetic(α, β) the
    x of `public-size` samples drawn as one more client (index −1) would."""
    kind, params = parse_dataset(cfg.dataset)
    if kind == "hub":
        raise ValueError(f"dataset {cfg.dataset!r} has no embedded public set: give PerFed-CKT one with public-dir")
    if kind != "synthetic":
        return data_lib.embedded_public(cfg.public_size, cfg.seed, cfg.dataset)
    rng = np.random.default_rng([cfg.seed, 0x9B])
    return _synthetic_features(rng, rng.normal(0, params[1]), cfg.public_size)


def _synthetic_features(rng: np.random.Generator, b_mean: float, size: int) -> np.ndarray:
    """`size` samples x ~ N(v, Σ), v ~ N(B, 1), Σ_jj = j^(−1.2)."""
    v = rng.normal(b_mean, 1, SYNTHETIC_FEATURES)
    std = np.arange(1, SYNTHETIC_FEATURES + 1) ** -0.6  # √(j^−1.2)
    return (v + std * rng.standard_normal((size, SYNTHETIC_FEATURES))).astype(np.float32)
