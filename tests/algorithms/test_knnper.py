"""kNN-Per on a real node: embedded digits, a trained CNN, a FAISS datastore in a state folder."""

import numpy as np
import pytest

from florist.algorithms.knnper import client as knnper
from florist.algorithms.knnper.datastore import Datastore
from florist.cli import main
from florist.client.node import Node
from florist.common import data, training


@pytest.fixture
def knn_node(make_node):
    def make(**config) -> Node:
        values = {"strategy": "knnper", "partition": "pathological:2"} | config
        node = make_node(values)
        client = data.embedded_client(4, 10, node.cfg.partition, node.cfg.seed, node.cfg.val_fraction,
                                      node.cfg.test_fraction, public_size=node.cfg.public_size)  # fmt: skip
        node.data = client
        return node

    return make


@pytest.fixture
def trained(knn_node):
    node = knn_node()
    model = node.new_model()
    node.fit(model, epochs=3)  # a partly trained "global" model
    return node, model


def test_lambda_zero_reproduces_the_global_model_on_every_test_point(trained):
    node, model = trained
    store = knnper.datastore_for(node, model, "v1")
    p_global = training.predict_proba(model, node.data.x_test)
    embeddings = training.embed(model, node.data.x_test)
    for k in (1, 5, 10):
        mixed = knnper.mix(knnper.stored_proba(node, store, embeddings, k), p_global, 0.0)
        assert np.array_equal(mixed, p_global)
        assert (mixed.argmax(1) == p_global.argmax(1)).all()


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
    assert main(["datastore", "add", "--state-dir", state_dir, "--node-key", "partition-4", "--data-dir", str(new)]) == 0
    store = Datastore.load(node.state)
    assert len(store) == 60  # the newest 60 kept: the folder's 25 train samples last, its test split not at all
    found = ((store.embeddings[-25:, None] - training.embed(model, x[:25])[None]) ** 2).sum(-1).argmin(1)
    assert sorted(found.tolist()) == list(range(25)) and (store.labels[-25:] == y[found]).all()


def test_datastore_add_without_a_datastore_says_so(tmp_path):
    assert main(["datastore", "add", "--state-dir", str(tmp_path), "--node-key", "n1", "--data-dir", str(tmp_path)]) == 2
