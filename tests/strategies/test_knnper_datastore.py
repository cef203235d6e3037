import dataclasses

import faiss
import numpy as np
import pytest

from florist.cli import main
from florist.client.state import NodeState
from florist.common import data as data_lib
from florist.common import scenarios, training
from florist.strategies.knnper import client as knnper
from florist.strategies.knnper.datastore import Datastore


def brute_force(stored, queries, k):
    d = ((queries[:, None, :] - stored[None, :, :]) ** 2).sum(-1)
    order = np.argsort(d, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(d, order, 1), order


def test_flat_search_equals_numpy_brute_force():
    rng = np.random.default_rng(0)
    stored, queries = rng.random((500, 16), dtype=np.float32), rng.random((40, 16), dtype=np.float32)
    store = Datastore(16)
    store.add(stored, np.arange(500))
    distances, labels = store.search(queries, 7)
    want_d, want_ids = brute_force(stored.astype(np.float64), queries.astype(np.float64), 7)
    assert np.allclose(distances, want_d, rtol=1e-4, atol=1e-5)
    assert (labels == want_ids).mean() > 0.99  # identical up to float ties


@pytest.mark.parametrize("index_type", ["flat", "hnsw", "ivf"])
def test_a_stored_point_finds_its_own_label(index_type):
    rng = np.random.default_rng(1)
    stored, labels = rng.random((300, 8), dtype=np.float32), rng.integers(0, 10, 300)
    store = Datastore(8, index_type)
    store.add(stored, labels)
    _, found = store.search(stored, 1)
    assert (found[:, 0] == labels).mean() >= (1.0 if index_type == "flat" else 0.95)


def _add(store, start, count):
    store.add(
        np.full((count, 2), start, dtype=np.float32) + np.arange(count, dtype=np.float32)[:, None],
        np.arange(start, start + count),
    )


def test_policies_and_capacity():
    fifo, fixed, concat = (
        Datastore(2, capacity=5, policy="fifo"),
        Datastore(2, capacity=5, policy="fixed"),
        Datastore(2),
    )
    for store in (fifo, fixed, concat):
        _add(store, 0, 4)
        _add(store, 100, 4)
    assert fifo.labels.tolist() == [2, 3, 100, 101, 102, 103][-5:]  # the newest five
    assert fixed.labels.tolist() == [0, 1, 2, 3, 100]  # the first five; later ones ignored
    assert concat.labels.tolist() == [0, 1, 2, 3, 100, 101, 102, 103]
    assert fifo.index.ntotal == 5 and fixed.index.ntotal == 5 and concat.index.ntotal == 8
    with pytest.raises(ValueError, match="needs a capacity"):
        Datastore(2, policy="fifo")


def test_joined_is_a_copy_under_the_policy_and_leaves_the_store_alone():
    store = Datastore(2, capacity=5, policy="fifo")
    _add(store, 0, 4)
    whole = store.joined(np.full((2, 2), 50, dtype=np.float32), np.array([50, 51]))
    assert whole.labels.tolist() == [1, 2, 3, 50, 51] and whole.index.ntotal == 5  # still the newest five
    assert store.labels.tolist() == [0, 1, 2, 3] and store.index.ntotal == 4 and len(store.embeddings) == 4


def test_persistence_survives_a_restart_and_stale_stores_are_rebuilt(tmp_path):
    state = NodeState(tmp_path, "node-a")
    store = Datastore(4, "hnsw", model_version="abc")
    rng = np.random.default_rng(2)
    store.add(rng.random((50, 4), dtype=np.float32), rng.integers(0, 3, 50))
    store.save(state)
    again = Datastore.load(NodeState(tmp_path, "node-a"), model_version="abc", dim=4, index_type="hnsw")
    assert again is not None and (again.labels == store.labels).all()
    assert isinstance(again.index, faiss.IndexHNSWFlat) and again.index.ntotal == 50
    queries = rng.random((5, 4), dtype=np.float32)
    assert (again.search(queries, 3)[1] == store.search(queries, 3)[1]).all()
    assert Datastore.load(state, model_version="other", dim=4) is None  # another global model
    assert Datastore.load(state, model_version="abc", dim=8) is None  # another embedding size
    assert Datastore.load(NodeState(tmp_path, "node-b"), model_version="abc") is None  # nothing saved


@pytest.mark.parametrize(
    "damage",
    [
        {"labels": np.array([0, 1, 99] * 10)},  # outside [0, num_classes)
        {"labels": np.zeros(5, dtype=np.int64)},  # fewer labels than embeddings
        {"embeddings": np.full((30, 4), np.nan, dtype=np.float32)},
        {"embeddings": np.zeros((30, 7), dtype=np.float32)},  # another dimension than recorded
    ],
)
def test_a_damaged_store_is_rebuilt_and_its_index_never_read_back(tmp_path, damage):
    """The FAISS index is rebuilt from the stored pairs: garbage under the old `index` key (what
    earlier versions saved, and a corrupted HNSW file could hang a search) is never read."""
    state = NodeState(tmp_path, "node-a")
    store = Datastore(4, "hnsw", num_classes=3)
    store.add(np.random.default_rng(0).random((30, 4), dtype=np.float32), np.arange(30) % 3)
    store.save(state)
    saved = state.load_arrays("datastore.npz")
    state.save_arrays("datastore.npz", saved | {"index": np.frombuffer(b"\xff" * 64, dtype=np.uint8)})
    assert Datastore.load(state).index.ntotal == 30  # garbage index ignored
    state.save_arrays("datastore.npz", saved | damage)
    assert Datastore.load(state) is None  # the caller rebuilds it from the node's data


def test_bad_embeddings_are_refused():
    store = Datastore(3)
    with pytest.raises(ValueError, match="N×3"):
        store.add(np.zeros((2, 4), dtype=np.float32), np.zeros(2))
    with pytest.raises(ValueError, match="NaN"):
        store.add(np.full((1, 3), np.nan, dtype=np.float32), np.zeros(1))
    with pytest.raises(ValueError, match="empty"):
        store.search(np.zeros((1, 3), dtype=np.float32), 1)


# --- what a node's datastore is built from ----------------------------------------------------
KNN = {"strategy": "knnper", "knn-policy": "fifo", "knn-capacity": 1000}


def _marked_store(node, model) -> int:
    """Build the node's datastore and add three marker entries: a reused store still holds them,
    a rebuilt one holds the node's train split only. Returns the marked size."""
    store = knnper.datastore_for(node, model, "v1")
    store.add(np.full((3, store.dim), 7.0, dtype=np.float32), np.zeros(3, dtype=np.int64))
    store.save(node.state)
    return len(store)


def _another_partition(node):
    return scenarios.client_data(3, 5, node.cfg)


def _first_train_point_moved_to_test(node):
    d = node.data
    return dataclasses.replace(
        d,
        x_train=d.x_train[1:],
        y_train=d.y_train[1:],
        x_test=np.concatenate([d.x_train[:1], d.x_test]),
        y_test=np.concatenate([d.y_train[:1], d.y_test]),
    )


def _relabelled(node):
    return dataclasses.replace(node.data, y_train=(node.data.y_train + 1) % node.data.num_classes)


CHANGES = {
    "another partition": ({}, _another_partition),
    "another split": ({}, _first_train_point_moved_to_test),
    "other train labels": ({}, _relabelled),
    "another policy": ({"knn-policy": "concat"}, None),
    "another capacity": ({"knn-capacity": 999}, None),
}


@pytest.mark.parametrize("change", CHANGES, ids=list(CHANGES))
def test_a_store_is_rebuilt_when_the_train_data_or_its_settings_change(make_node, change):
    settings, new_data = CHANGES[change]
    node = make_node(KNN)
    model = node.new_model()
    _marked_store(node, model)
    changed = make_node(KNN | settings, key=node.key, data=new_data(node) if new_data else None)
    store = knnper.datastore_for(changed, model, "v1")  # same global model, same state folder
    d = changed.data
    assert len(store) == len(d.x_train) and (store.labels == d.y_train).all()  # the node's own split, no marks
    assert np.allclose(store.embeddings, training.embed(model, d.x_train), atol=1e-5)


def test_a_store_is_reused_when_nothing_changed(make_node):
    node = make_node(KNN)
    model = node.new_model()
    size = _marked_store(node, model)
    restarted = make_node(KNN, key=node.key)  # the same data, settings and state folder
    assert size == len(node.data.x_train) + 3 and len(knnper.datastore_for(restarted, model, "v1")) == size


def test_datastore_add_takes_a_folders_train_split_and_never_its_test_split(tmp_path, make_node):
    node = make_node({"strategy": "knnper"})
    model = node.new_model()
    before = len(knnper.datastore_for(node, model, "v1"))
    x, y = data_lib.load_digits()
    folder = tmp_path / "new"
    folder.mkdir()
    np.savez(folder / "train.npz", x=x[:30], y=y[:30])
    np.savez(folder / "test.npz", x=x[30:50], y=y[30:50])
    args = ["datastore", "add", "--state-dir", str(node.state.folder.parent), "--node-key", node.key]
    assert main(args + ["--data-dir", str(folder)]) == 0
    store = Datastore.load(node.state)
    added, labels = store.embeddings[before:], store.labels[before:]
    distances = ((added[:, None, :] - training.embed(model, x[:50])[None, :, :]) ** 2).sum(-1)
    found = distances.argmin(1)  # which of the folder's 50 samples each new entry is
    assert len(store) == before + 30 and np.allclose(distances.min(1), 0, atol=1e-8)
    assert sorted(found.tolist()) == list(range(30)) and (labels == y[found]).all()  # each train sample once
