"""kNN-Per's datastore: (embedding, label) pairs in a FAISS index, kept on the node.

It lives in the node's state folder with metadata naming what it was built from: the global
model (`model_version`, a hash of its weights), the train split (`train_data`, a hash of its x
and y), the embedding dimension, index type, policy and capacity. A restarted node reuses it;
one built for another model, other data (another partition, split or run) or other settings is
detected and rebuilt, never silently used: it could hold the node's current test points.
The saved store holds the train split and samples added later; the validation split, which λ
and k are chosen on, only joins an unsaved copy (`joined`) that scores the test split.
New local samples can be added without retraining the global model (the paper's
distribution-shift experiment), under a capacity and an update policy:

- `concat`: keep everything (capacity ignored);
- `fifo`: keep the newest `capacity` entries;
- `fixed`: keep the first `capacity` entries and ignore later ones.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math

import faiss
import numpy as np

from florist.client.state import NodeState
from florist.common import data as data_lib
from florist.strategies.knnper.spec import INDEX_TYPES, POLICIES

log = logging.getLogger("flwr").getChild(__name__)

FILE, META = "datastore.npz", "datastore.json"


def train_fingerprint(x: np.ndarray, y: np.ndarray) -> str:
    """`N-hash` of a labelled split: the samples' fingerprint extended with their labels, so a
    relabelled or reordered split counts as other data."""
    digest = hashlib.sha256(data_lib.fingerprint(x).encode())
    digest.update(np.ascontiguousarray(y, dtype=np.int64).tobytes())
    return f"{len(x)}-{digest.hexdigest()[:16]}"


class Datastore:
    def __init__(self, dim: int, index_type: str = "flat", capacity: int = 0, policy: str = "concat", **meta):
        if index_type not in INDEX_TYPES:
            raise ValueError(f"unknown datastore index {index_type!r}; choose one of: {', '.join(INDEX_TYPES)}")
        if policy not in POLICIES:
            raise ValueError(f"unknown datastore policy {policy!r}; choose one of: {', '.join(POLICIES)}")
        if policy != "concat" and capacity < 1:
            raise ValueError(f"datastore policy {policy!r} needs a capacity >= 1, got {capacity}")
        self.dim, self.index_type, self.capacity, self.policy = dim, index_type, capacity, policy
        self.meta = dict(meta)
        self.embeddings = np.zeros((0, dim), dtype=np.float32)
        self.labels = np.zeros(0, dtype=np.int64)
        self.index = self._build_index(self.embeddings)

    def __len__(self) -> int:
        return len(self.labels)

    def add(self, embeddings: np.ndarray, labels: np.ndarray) -> None:
        """Add pairs under the policy; the FAISS index is rebuilt when entries are evicted."""
        embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
        if embeddings.ndim != 2 or embeddings.shape[1] != self.dim or len(embeddings) != len(labels):
            raise ValueError(
                f"datastore expects N×{self.dim} embeddings with N labels, got {embeddings.shape} and {len(labels)}"
            )
        if not np.isfinite(embeddings).all():
            raise ValueError("datastore embeddings contain NaN or Inf")
        if self.policy == "fixed":
            room = max(0, self.capacity - len(self))
            embeddings, labels = embeddings[:room], labels[:room]
        all_embeddings = np.concatenate([self.embeddings, embeddings])
        all_labels = np.concatenate([self.labels, np.asarray(labels, dtype=np.int64)])
        if self.policy == "fifo" and len(all_labels) > self.capacity:
            all_embeddings, all_labels = all_embeddings[-self.capacity :], all_labels[-self.capacity :]
        self.embeddings, self.labels = all_embeddings, all_labels
        self.index = self._build_index(self.embeddings)

    def joined(self, embeddings: np.ndarray, labels: np.ndarray) -> Datastore:
        """A copy with these pairs added under the policy, this store unchanged (`add` replaces
        the arrays and the index, never writes into them)."""
        other = copy.copy(self)
        other.meta = dict(self.meta)
        other.add(embeddings, labels)
        return other

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Squared L2 distances and labels of the k nearest stored entries (k ≤ size)."""
        if len(self) == 0:
            raise ValueError("the datastore is empty: build it from labelled training data first")
        k = min(k, len(self))
        distances, ids = self.index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
        return distances, self.labels[ids]

    def _build_index(self, embeddings: np.ndarray) -> faiss.Index:
        if self.index_type == "hnsw":
            index = faiss.IndexHNSWFlat(self.dim, 32)
            index.hnsw.efSearch = 64
        elif self.index_type == "ivf" and len(embeddings) > 0:
            nlist = max(1, int(math.sqrt(len(embeddings))))
            index = faiss.IndexIVFFlat(faiss.IndexFlatL2(self.dim), self.dim, nlist)
            index.train(embeddings)
            index.nprobe = max(1, nlist // 4)
        else:  # flat, and an empty ivf (nothing to train on yet)
            index = faiss.IndexFlatL2(self.dim)
        index.add(embeddings)
        return index

    # --- persistence -----------------------------------------------------------------------
    def save(self, state: NodeState) -> None:
        state.save_arrays(FILE, {"embeddings": self.embeddings, "labels": self.labels})  # the index is rebuilt
        state.save_json(
            META,
            {
                "dim": self.dim,
                "index_type": self.index_type,
                "capacity": self.capacity,
                "policy": self.policy,
                "size": len(self),
            }
            | self.meta,
        )

    @classmethod
    def load(cls, state: NodeState, **expected) -> Datastore | None:
        """The saved datastore, or None when there is none or it does not match `expected`
        (e.g. `model_version`, `train_data`, `dim`, `index_type`, `policy`, `capacity`): a stale
        store must be rebuilt. A key the store never recorded does not match."""
        meta = state.load_json(META)
        if meta is None:
            return None
        stale = {k: (meta.get(k), v) for k, v in expected.items() if meta.get(k) != v}
        if stale:
            log.info(
                "node %s: datastore is stale (%s), rebuilding",
                state.key,
                ", ".join(f"{k} {old!r} != {new!r}" for k, (old, new) in stale.items()),
            )
            return None
        arrays = state.load_arrays(FILE)
        if arrays is None:
            return None
        known = {"dim", "index_type", "capacity", "policy", "size"}
        store = cls(
            meta["dim"],
            meta["index_type"],
            meta["capacity"],
            meta["policy"],
            **{k: v for k, v in meta.items() if k not in known},
        )
        if problem := _damage(arrays, meta):
            log.warning("node %s: the saved datastore is damaged (%s), rebuilding it", state.key, problem)
            return None
        # Rebuilt from the stored pairs, not read back: a FAISS file is trusted code's input only.
        store.embeddings, store.labels = arrays["embeddings"], arrays["labels"]
        store.index = store._build_index(store.embeddings)
        return store


def _damage(arrays: dict[str, np.ndarray], meta: dict) -> str:
    """What is wrong with a saved datastore's arrays ("" when nothing)."""
    embeddings, labels = arrays.get("embeddings"), arrays.get("labels")
    if not isinstance(embeddings, np.ndarray) or not isinstance(labels, np.ndarray):
        return "embeddings or labels missing"
    if embeddings.dtype != np.float32 or embeddings.ndim != 2 or embeddings.shape[1] != meta["dim"]:
        return f"embeddings are {embeddings.dtype} {embeddings.shape}, expected float32 N×{meta['dim']}"
    if labels.dtype != np.int64 or labels.shape != (len(embeddings),):
        return f"labels are {labels.dtype} {labels.shape}, expected int64 ({len(embeddings)},)"
    if not np.isfinite(embeddings).all():
        return "embeddings contain NaN or Inf"
    num_classes = meta.get("num_classes")
    if len(labels) and (labels.min() < 0 or (isinstance(num_classes, int) and labels.max() >= num_classes)):
        return f"labels outside [0, {num_classes})"
    return ""
