"""Client half of kNN-Per (Marfoq et al., 2022): the global model from FedAvg, plus a local
FAISS datastore of (features(x), y) pairs from the train split, mixed as
λ·p_kNN + (1 − λ)·p_global with λ and k chosen per client on its validation split."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import RecordDict

from florist.client.datastore import Datastore
from florist.client.fedavg import received_model
from florist.client.node import Node
from florist.client.state import NodeState
from florist.common import data as data_lib
from florist.common import knn, protocol, training
from florist.common.models import Net, build_model

GLOBAL_MODEL = "knnper-global.npz"  # kept beside the datastore so new samples can be embedded later


def datastore_for(node: Node, model: Net, version: str) -> Datastore:
    """The node's datastore for this global model: reused if it was built for it (same
    version, dimension and index type), else rebuilt from the train split and saved."""
    cfg, d = node.cfg, node.data
    index_type = str(node.node_config.get("knn-index", cfg.knn_index))
    dim = training.embed(model, d.x_train[:1]).shape[1]
    store = Datastore.load(node.state, model_version=version, dim=dim, index_type=index_type)
    if store is None:
        store = Datastore(dim, index_type, cfg.knn_capacity, cfg.knn_policy, model_version=version, model=cfg.model,
                          input_shape=list(d.input_shape), num_classes=cfg.num_classes)  # fmt: skip
        store.add(training.embed(model, d.x_train), d.y_train)
        store.save(node.state)
        node.state.save_arrays(GLOBAL_MODEL, {k: v.numpy() for k, v in model.state_dict().items()})
    return store


def knn_proba(node: Node, store: Datastore, embeddings: np.ndarray, k: int) -> np.ndarray:
    """p_kNN for already-embedded inputs from their k nearest stored embeddings."""
    return knn.knn_proba(*store.search(embeddings, k), node.cfg.num_classes, node.cfg.knn_sigma)


def evaluate(node: Node, content: RecordDict) -> RecordDict:
    """Build (or reuse) the datastore for the received global model, choose λ and k on the
    validation split, and score the mixture on the test split beside the global model (λ = 0)."""
    model = received_model(node, content)
    store = datastore_for(node, model, content.array_records[protocol.ARRAYS].object_id)
    d = node.data
    emb_val = training.embed(model, d.x_val)  # once, searched for every k of the grid
    by_k = {k: knn_proba(node, store, emb_val, k) for k in node.cfg.knn_k_grid}
    choice = knn.select(training.predict_proba(model, d.x_val), by_k, d.y_val)
    p_global = training.predict_proba(model, d.x_test)
    mixed = knn.mix(knn_proba(node, store, training.embed(model, d.x_test), choice.k), p_global, choice.lam)
    extra = {"global-accuracy": float((p_global.argmax(1) == d.y_test).mean()), "lambda": choice.lam,
             "k": choice.k, "datastore-size": len(store)}  # fmt: skip
    return node.score_reply(mixed, **extra)


def add_samples(state: NodeState, data_dir: str, seed: int = 0) -> tuple[int, int]:
    """Add a folder's labelled samples (train and test splits alike) to the node's datastore
    without retraining the global model: embed them with the global model the datastore was
    built with, apply the capacity policy, save. Returns (size before, size after)."""
    store = Datastore.load(state)
    weights = state.load_arrays(GLOBAL_MODEL)
    if store is None or weights is None:
        raise FileNotFoundError(
            f"no kNN-Per datastore in {state.folder}: it is built the first time the node is evaluated with "
            "strategy knnper"
        )
    new = data_lib.folder_client(data_dir, store.meta["num_classes"], seed, val_fraction=0.5)
    if not new.labelled:
        raise ValueError(f"{data_dir}: datastore entries need labels (array y)")
    if new.input_shape != tuple(store.meta["input_shape"]):
        raise ValueError(f"{data_dir}: samples have shape {new.input_shape}, the datastore's model expects "
                         f"{tuple(store.meta['input_shape'])}")  # fmt: skip
    model = build_model(store.meta["model"], new.input_shape, store.meta["num_classes"])
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    before = len(store)
    x = np.concatenate([new.x_train, new.x_val, new.x_test])
    y = np.concatenate([new.y_train, new.y_val, new.y_test])
    store.add(training.embed(model, x), y)
    store.save(state)
    return before, len(store)
