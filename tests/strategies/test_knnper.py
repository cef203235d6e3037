"""kNN-Per on a real node: embedded digits, a trained CNN, a FAISS datastore in a state folder."""

import numpy as np
import pytest

from florist.cli import main
from florist.client.node import Node
from florist.common import data, training
from florist.strategies.knnper import client as knnper
from florist.strategies.knnper.datastore import Datastore


@pytest.fixture
def knn_node(make_node):
    def make(**config) -> Node:
        values = {"strategy": "knnper", "partition": "pathological:2"} | config
        node = make_node(values)
        client = data.embedded_client(
            4,
            10,
            node.cfg.partition,
            node.cfg.seed,
            node.cfg.val_fraction,
            node.cfg.test_fraction,
            public_size=node.cfg.public_size,
        )
        node.data = client
        return node

    return make


@pytest.fixture
def trained(knn_node):
    node = knn_node()
    model = node.new_model()
    node.fit(model, epochs=3)  # a partly trained "global" model
    return node, model


@pytest.mark.parametrize("k", [1, 7, 10_000])
def test_lambda_zero_scores_exactly_as_the_global_model_for_every_k(make_node, k):
    """λ forced to 0 through the real datastore and its search: the test probabilities are the
    global model's bit for bit, which needs a finite N×C p_kNN for this k (10,000 is more than
    the store holds) even where σ is so small that every exp(−d/σ) underflows unshifted."""
    node = make_node(
        {"strategy": "knnper", "knn-select": "client", "knn-ks": str(k), "knn-sigmas": "1e-5", "knn-kernel": "squared"}
    )
    model = node.new_model()
    scored = knnper.personalize(node, model, knnper.datastore_for(node, model, "v1"), lambdas=(0.0,))
    assert scored.choice.k == k and scored.choice.lam == 0.0
    assert np.array_equal(scored.mixed, training.predict_proba(model, node.data.x_test))


def vote(stored: np.ndarray, labels: np.ndarray, queries: np.ndarray, k: int, sigma: float) -> np.ndarray:
    """p_kNN by its definition, in float64 and without FAISS: each of a query's k nearest stored
    points adds exp(−d/σ) to its label, d the Euclidean distance (the paper's kernel)."""
    p = np.zeros((len(queries), 10))
    for row, query in zip(p, queries.astype(np.float64)):
        d = np.sqrt(((stored.astype(np.float64) - query) ** 2).sum(1))
        for i in np.argsort(d, kind="stable")[:k]:
            row[labels[i]] += np.exp(-d[i] / sigma)
    return p / p.sum(1, keepdims=True)


def test_lambda_one_is_the_knn_vote_over_the_train_and_validation_pairs(make_node):
    """λ forced to 1, k = 3, a tiny store: eight train digits 0 and 1, four validation digits
    relabelled 9 (no train point has 9). λ and k are chosen without the validation pairs (so no
    validation point can be right); the test split, the four validation images and four more,
    is scored with them (each of the four finds itself); the saved store keeps the eight."""
    x, y = data.load_digits()
    train, rest = np.flatnonzero(y < 2)[:8], np.flatnonzero(y >= 2)[:8]
    tiny = data.ClientData(x[train], y[train], x[rest[:4]], np.full(4, 9), x[rest], y[rest], num_classes=10)
    node = make_node({"strategy": "knnper", "knn-select": "client", "knn-ks": "3", "knn-sigmas": "0.02"}, data=tiny)
    model = node.new_model()
    scored = knnper.personalize(node, model, knnper.datastore_for(node, model, "v1"), lambdas=(1.0,))
    stored = training.embed(model, np.concatenate([tiny.x_train, tiny.x_val]))
    want = vote(stored, np.concatenate([tiny.y_train, tiny.y_val]), training.embed(model, tiny.x_test), 3, 0.02)
    np.testing.assert_allclose(scored.mixed, want, atol=1e-5)
    assert (scored.mixed.argmax(1)[:4] == 9).all()
    assert scored.choice.accuracy == 0.0 and scored.datastore_size == 12
    assert len(Datastore.load(node.state)) == 8


def test_datastore_holds_the_train_split_and_is_reused_for_the_same_model(trained):
    node, model = trained
    store = knnper.datastore_for(node, model, "v1")
    assert len(store) == len(node.data.x_train) and store.dim == 128
    _, labels = store.search(training.embed(model, node.data.x_train), 1)
    assert (labels[:, 0] == node.data.y_train).all()  # each stored point finds itself
    store.add(store.embeddings[:3], store.labels[:3])
    store.save(node.state)
    assert len(knnper.datastore_for(node, model, "v1")) == len(node.data.x_train) + 3  # reused, not rebuilt
    assert len(knnper.datastore_for(node, model, "v2")) == len(node.data.x_train)  # new global model: rebuilt


def test_datastore_add_command_embeds_new_samples_under_fifo(tmp_path, knn_node):
    node = knn_node(**{"knn-policy": "fifo", "knn-capacity": 60})
    model = node.new_model()
    knnper.datastore_for(node, model, "v1")
    x, y = data.load_digits()
    new = tmp_path / "new"
    new.mkdir()
    for split in ("train", "test"):
        np.savez(new / f"{split}.npz", x=x[:25], y=y[:25])
    state_dir = str(node.state.folder.parent)
    assert (
        main(["datastore", "add", "--state-dir", state_dir, "--node-key", "partition-4", "--data-dir", str(new)]) == 0
    )
    store = Datastore.load(node.state)
    assert len(store) == 60  # the newest 60 kept: the folder's 25 train samples last, its test split not at all
    found = ((store.embeddings[-25:, None] - training.embed(model, x[:25])[None]) ** 2).sum(-1).argmin(1)
    assert sorted(found.tolist()) == list(range(25)) and (store.labels[-25:] == y[found]).all()


def test_datastore_add_without_a_datastore_says_so(tmp_path):
    assert (
        main(["datastore", "add", "--state-dir", str(tmp_path), "--node-key", "n1", "--data-dir", str(tmp_path)]) == 2
    )


@pytest.mark.parametrize("path", ["choose", "kept"])
def test_the_evaluation_path_mixes_the_knn_even_at_lambda_zero(make_node, monkeypatch, path):
    """With λ = 0 chosen on validation (`choose`) or kept from phase 1 (`kept`), the test split
    is still scored through the kNN and the mixture: a poisoned p_kNN (NaN) must surface. A
    shortcut that skipped the search or the mixture at λ = 0 would return p_global instead."""
    node = make_node({"strategy": "knnper", "knn-select": "client", "knn-ks": "3"})
    model = node.new_model()
    store = knnper.datastore_for(node, model, "v1")
    calls = []

    def poisoned(distances, labels, num_classes, sigma, kernel="paper"):
        calls.append(len(distances))
        return np.full((len(distances), num_classes), np.nan)

    monkeypatch.setattr(knnper, "knn_proba", poisoned)
    kept = knnper.Choice(0.0, 3, 1.0, 0.0, 1.0) if path == "kept" else None
    with pytest.raises(ValueError, match="p_kNN"):
        knnper.personalize(node, model, store, lambdas=(0.0,), choice=kept)
    assert calls  # the kNN was searched and voted, not skipped
