import faiss
import numpy as np
import pytest

from florist.algorithms.knnper.datastore import Datastore
from florist.client.state import NodeState


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
    store.add(np.full((count, 2), start, dtype=np.float32) + np.arange(count, dtype=np.float32)[:, None],
              np.arange(start, start + count))  # fmt: skip


def test_policies_and_capacity():
    fifo, fixed, concat = Datastore(2, capacity=5, policy="fifo"), Datastore(2, capacity=5, policy="fixed"), Datastore(2)
    for store in (fifo, fixed, concat):
        _add(store, 0, 4)
        _add(store, 100, 4)
    assert fifo.labels.tolist() == [2, 3, 100, 101, 102, 103][-5:]  # the newest five
    assert fixed.labels.tolist() == [0, 1, 2, 3, 100]  # the first five; later ones ignored
    assert concat.labels.tolist() == [0, 1, 2, 3, 100, 101, 102, 103]
    assert fifo.index.ntotal == 5 and fixed.index.ntotal == 5 and concat.index.ntotal == 8
    with pytest.raises(ValueError, match="needs a capacity"):
        Datastore(2, policy="fifo")


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


def test_bad_embeddings_are_refused():
    store = Datastore(3)
    with pytest.raises(ValueError, match="N×3"):
        store.add(np.zeros((2, 4), dtype=np.float32), np.zeros(2))
    with pytest.raises(ValueError, match="NaN"):
        store.add(np.full((1, 3), np.nan, dtype=np.float32), np.zeros(1))
    with pytest.raises(ValueError, match="empty"):
        store.search(np.zeros((1, 3), dtype=np.float32), 1)
