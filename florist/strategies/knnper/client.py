"""kNN-Per's client half: the global model from FedAvg, plus a local FAISS datastore of
(features(x), y) pairs (`datastore.py`), mixed as λ·p_kNN + (1 − λ)·p_global.

λ, k and σ are chosen per client (as `knn-select` says) on its validation split against the
store of its train split: a validation point in the store would find itself, with its own
label, and favour large λ. The test split is then scored with the validation pairs joined to a
copy of that store, so it holds the client's whole training set, as the paper's does. The
saved store never holds them.

Under `knn-train-on-val`, phase 2 trains on train + validation, so a seen client's validation
split no longer tells how well the global model generalizes: it keeps the choice made with
phase 1's final model (sent beside the current one) and scores the test split with it.

Both terms are probabilities, so the mixture is one too (the reference code's default mixes
logits with probabilities, which is not a distribution; florist does not)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from flwr.app import RecordDict

from florist.client import personal
from florist.client.node import Node, Request
from florist.client.state import NodeState
from florist.common import folders, protocol, training
from florist.common.models import Net, build_model
from florist.common.storage import atomic_write
from florist.common.training import log_loss
from florist.strategies.fedavg import client as fedavg_client
from florist.strategies.knnper.datastore import Datastore, train_fingerprint
from florist.strategies.knnper.spec import KNNPER, in_phase_two, phase_rounds

GLOBAL_MODEL = "global.npz"  # kept beside the datastore so new samples can be embedded later
CHOICE = "choice"  # phase 1's (λ, k, σ) under knn-train-on-val, a `save_round` version of the run
LAMBDA_GRID = tuple(round(0.1 * i, 1) for i in range(11))


def knn_proba(
    distances: np.ndarray, labels: np.ndarray, num_classes: int, sigma: float, kernel: str = "paper"
) -> np.ndarray:
    """p_kNN for each query from its k neighbours' squared-L2 distances (FAISS's) and labels
    (N×k each). `paper` weighs a neighbour by exp(−d/σ) with d the Euclidean distance (Eqs. 6
    and 40); `squared` by exp(−d²/σ), which on 128-d features is near one-hot for σ ~ 1.

    Distances are shifted by each row's minimum before exponentiating: the shift cancels in
    the normalisation and keeps exp() from underflowing to an all-zero row.
    """
    if kernel == "paper":
        distances = np.sqrt(np.maximum(distances, 0.0))  # FAISS may return -1e-7 for a point itself
    elif kernel != "squared":
        raise ValueError(f"unknown kNN kernel {kernel!r}: paper or squared")
    weights = np.exp(-(distances - distances.min(axis=1, keepdims=True)) / sigma)
    proba = np.zeros((len(distances), num_classes))
    np.add.at(proba, (np.arange(len(distances))[:, None], labels), weights)
    return proba / proba.sum(axis=1, keepdims=True)


def mix(p_knn: np.ndarray, p_global: np.ndarray, lam: float) -> np.ndarray:
    """λ·p_kNN + (1 − λ)·p_global. No shortcut at λ = 0: the sum is still p_global bit for bit
    when p_kNN is a finite N×C array, and a NaN or misshapen p_kNN does not go unnoticed."""
    if p_knn.shape != p_global.shape or not np.isfinite(p_knn).all():
        raise ValueError(f"p_kNN must be a finite {p_global.shape} array, got {p_knn.shape} with NaN/Inf or not")
    return lam * p_knn + (1 - lam) * p_global


@dataclasses.dataclass(frozen=True)
class Choice:
    lam: float
    k: int
    accuracy: float
    loss: float
    sigma: float = 1.0


def select(
    p_global: np.ndarray,
    p_knn_by: dict[tuple[int, float], np.ndarray],
    y: np.ndarray,
    lambdas=LAMBDA_GRID,
    prior: tuple[float, int, float] | None = None,
    prior_weight: float = 0.0,
) -> Choice:
    """The (λ, k, σ) with the best validation accuracy (`p_knn_by` maps (k, σ) to p_kNN); ties
    broken by the lower validation log-loss (a few dozen samples leave many λ tied: the log-loss
    picks the λ the data support, not the smallest), then by the smaller λ, k and σ. With a
    `prior` (λ, k, σ) the accuracy is shrunk toward it, (n·accuracy + n0·1{prior}) / (n + n0) for
    n validation samples and n0 = `prior_weight`: another candidate must get more than n0 more
    right, so a dozen digits keep the prior and a large split follows its own best."""
    if prior is not None and (prior[1], prior[2]) not in p_knn_by:
        raise ValueError(f"the prior (λ, k, σ) = {prior} needs p_kNN for k = {prior[1]}, σ = {prior[2]}")
    ranked = []
    for (k, sigma), p_knn in sorted(p_knn_by.items()):
        for lam in sorted(set(lambdas) | ({prior[0]} if prior is not None else set())):
            p = mix(p_knn, p_global, lam)
            c = Choice(lam, k, float((p.argmax(1) == y).mean()), log_loss(p, y), sigma)
            is_prior = (lam, k, sigma) == prior
            ranked.append(((-(len(y) * c.accuracy + prior_weight * is_prior), not is_prior, c.loss, lam, k, sigma), c))
    return min(ranked)[1]


def datastore_for(node: Node, model: Net, version: str) -> Datastore:
    """The node's datastore for this global model and train split: reused only if it was built
    from both (same version and train x, y) with the same dimension, index type, policy and
    capacity, else rebuilt from the train split and saved. A store of other data could hold
    this node's test points and score them by their own labels. The saved store holds the train
    split and samples added later, never the validation split (`personalize` joins it to a copy),
    so the hash of the train split covers every sample of this node's splits in it."""
    cfg, knn, d = node.cfg, node.cfg.settings, node.data
    if not d.labelled:
        raise ValueError(
            f"node {node.key}: kNN-Per's datastore holds (embedding, label) pairs, but the node's data has no y"
        )
    dim = training.embed(model, d.x_train[:1]).shape[1]  # on the CPU: one sample
    built_from = {
        "model_version": version,
        "train_data": train_fingerprint(d.x_train, d.y_train),
        "index_type": knn.index,
        "policy": knn.policy,
        "capacity": knn.capacity,
    }
    store = Datastore.load(node.state, dim=dim, **built_from)
    if store is None:
        store = Datastore(
            dim, **built_from, model=cfg.model, input_shape=list(d.input_shape), num_classes=cfg.num_classes
        )
        store.add(training.embed(model, d.x_train, device=node.device), d.y_train)
        store.save(node.state)
        node.state.save_arrays(GLOBAL_MODEL, {k: v.numpy() for k, v in model.state_dict().items()})
    return store


def stored_proba(node: Node, store: Datastore, embeddings: np.ndarray, k: int, sigma: float) -> np.ndarray:
    """p_kNN for already-embedded inputs from their k nearest stored embeddings."""
    return knn_proba(*store.search(embeddings, k), node.cfg.num_classes, sigma, node.cfg.settings.kernel)


def proba_grid(node: Node, store: Datastore, embeddings: np.ndarray) -> dict[tuple[int, float], np.ndarray]:
    """p_kNN for every (k, σ) a client chooses among (`knn-select`'s), from one search for the
    largest k: FAISS returns the neighbours nearest first, so the k nearest are the first k columns."""
    knn = node.cfg.settings
    distances, labels = store.search(embeddings, max(k for k, _ in knn.pairs))
    return {
        (k, sigma): knn_proba(distances[:, :k], labels[:, :k], node.cfg.num_classes, sigma, knn.kernel)
        for k, sigma in knn.pairs
    }


@dataclasses.dataclass(frozen=True)
class Scored:
    """The mixture's and the global model's test-split probabilities, the (λ, k, σ) chosen and
    the size of the store the test split was searched in."""

    mixed: np.ndarray
    p_global: np.ndarray
    choice: Choice
    store: Datastore

    @property
    def datastore_size(self) -> int:
        return len(self.store)


def choose(node: Node, model: Net, store: Datastore, lambdas=LAMBDA_GRID, emb_val: np.ndarray | None = None) -> Choice:
    """(λ, k, σ) chosen on the validation split against `store` (the train split's), as
    `knn-select` says: under `shrunk` toward `knn-prior`."""
    d, knn = node.data, node.cfg.settings
    emb_val = training.embed(model, d.x_val, device=node.device) if emb_val is None else emb_val
    p_global = training.predict_proba(model, d.x_val, device=node.device)
    prior = knn.prior_choice if knn.select == "shrunk" else None
    return select(p_global, proba_grid(node, store, emb_val), d.y_val, lambdas, prior, knn.prior_weight)


def personalize(node: Node, model: Net, store: Datastore, lambdas=LAMBDA_GRID, choice: Choice | None = None) -> Scored:
    """Choose λ, k and σ on the validation split against `store` (the train split's), unless
    `choice` was made already (phase 1's, under knn-train-on-val), then score the test split
    against a copy of the store with the validation pairs added under the store's policy."""
    d = node.data
    emb_val = training.embed(model, d.x_val, device=node.device)  # once: searched, then stored for the test split
    choice = choice or choose(node, model, store, lambdas, emb_val)
    whole = store.joined(emb_val, d.y_val)
    p_global = training.predict_proba(model, d.x_test, device=node.device)
    emb_test = training.embed(model, d.x_test, device=node.device)
    mixed = mix(stored_proba(node, whole, emb_test, choice.k, choice.sigma), p_global, choice.lam)
    return Scored(mixed, p_global, choice, whole)


def phase_one_choice(node: Node, request: Request) -> Choice | None:
    """Under knn-train-on-val in phase 2: the (λ, k, σ) this node chose with phase 1's final
    model (sent under `side`), kept in its state folder for the run and made on first need (a
    node that missed the end of phase 1 or lost its folder chooses the same). None otherwise,
    and for a node that never trained (unseen, late joiner): its validation split was in no
    training, so it chooses with the current model, as without the option."""
    knn, cfg = node.cfg.settings, node.cfg
    if not in_phase_two(knn, cfg.num_server_rounds, node.server_round) or not node.seen:
        return None
    if protocol.SIDE not in request.content.array_records:
        raise protocol.ProtocolError(
            f"node {node.key}: under knn-train-on-val, a phase-2 evaluation needs phase 1's model under 'side'"
        )
    version = request.content.array_records[protocol.SIDE].object_id
    kept = node.state.load_round(CHOICE, node.run_id, node.server_round)
    if kept is not None and kept[1].get("model_version") == version:
        try:
            return Choice(**kept[1]["choice"])
        except (KeyError, TypeError):  # a damaged file in the node's own folder: choose again
            pass
    chooser = node.new_model()
    chooser.load_state_dict(
        protocol.arrays_of(request.content, chooser.state_dict(), f"node {node.key}", protocol.SIDE)
    )
    d = node.data
    store = Datastore(training.embed(chooser, d.x_train[:1]).shape[1], knn.index, knn.capacity, knn.policy)
    store.add(training.embed(chooser, d.x_train, device=node.device), d.y_train)  # unsaved: one use per run
    choice = choose(node, chooser, store)
    last = phase_rounds(knn, cfg.num_server_rounds)
    node.state.save_round(CHOICE, {}, node.run_id, last, model_version=version, choice=dataclasses.asdict(choice))
    return choice


def train(node: Node, request: Request) -> RecordDict:
    """FedAvg's local training; in phase 2 of knn-train-on-val on the train and validation
    splits together (the reply's `num-examples` counts both; the server caps a node's weight
    at the train size it reported at discovery)."""
    knn, d = node.cfg.settings, node.data
    if in_phase_two(knn, node.cfg.num_server_rounds, node.server_round) and d.labelled:
        both = dataclasses.replace(
            d, x_train=np.concatenate([d.x_train, d.x_val]), y_train=np.concatenate([d.y_train, d.y_val])
        )
        node = dataclasses.replace(node, data=both)
    return fedavg_client.train(node, request)


def evaluate(node: Node, request: Request) -> RecordDict:
    """Build (or reuse) the datastore for the received global model and score the mixture on the
    test split beside the global model (λ = 0); with the (λ, k, σ) chosen and the store's size
    unless under dp, whose mechanism does not noise them."""
    model = node.received_model(request)
    store = datastore_for(node, model, request.content.array_records[protocol.ARRAYS].object_id)
    kept = phase_one_choice(node, request)
    scored = personalize(node, model, store, choice=kept)
    extra = {"global-accuracy": float((scored.p_global.argmax(1) == node.data.y_test).mean())}
    if node.cfg.dp == "none":  # under dp, what the node chose on its data stays on it (docs/privacy.md)
        chosen = scored.choice
        extra |= {"lambda": chosen.lam, "k": chosen.k, "sigma": chosen.sigma, "datastore-size": scored.datastore_size}
    if node.cfg.settings.train_on_val:
        extra["phase-one-choice"] = int(kept is not None)
    keep(node, model, scored)
    return node.score_reply(scored.mixed, **extra)


def keep(node: Node, model: Net, scored: Scored) -> None:
    """Keep what the test split was scored with: the global model, the store it was searched in
    (train + validation pairs) and the (λ, k, σ) and kernel of the mixture (`personal_proba`)."""
    store, choice = scored.store, scored.choice
    knn = {"lambda": choice.lam, "k": choice.k, "sigma": choice.sigma, "kernel": node.cfg.settings.kernel}
    extras = {"embeddings": store.embeddings, "labels": store.labels}
    personal.keep(node, model, scored.mixed, extras, knn=knn | {"index": store.index_type})


def personal_proba(kept: personal.Kept, model: Net, x: np.ndarray) -> np.ndarray:
    """A kept kNN-Per model's probabilities for `x`: the mixture its evaluation scored with,
    searched in the store it kept (rebuilt with its index type, as the evaluation built it)."""
    knn, extras = kept.manifest["knn"], kept.extras()
    store = Datastore(extras["embeddings"].shape[1], knn["index"])
    store.add(extras["embeddings"], extras["labels"])
    distances, labels = store.search(training.embed(model, x), int(knn["k"]))
    p_knn = knn_proba(distances, labels, kept.num_classes, float(knn["sigma"]), knn["kernel"])
    return mix(p_knn, training.predict_proba(model, x), float(knn["lambda"]))


@dataclasses.dataclass(frozen=True)
class Grown:
    """A store `add_samples` grew: which one (`datastore`: the state's, for the next runs;
    `kept`: a kept model's, for `florist predict` now) and its size before and after."""

    name: str
    before: int
    after: int
    kept: personal.Kept | None = None


@dataclasses.dataclass(frozen=True)
class _Target:
    """A store to grow, the network that embeds its entries (and its input), and how to write
    the store back once every store has taken the samples."""

    name: str
    store: Datastore
    model: Net
    input_shape: tuple[int, ...]
    num_classes: int
    save: Callable[[np.ndarray, np.ndarray], None]
    kept: personal.Kept | None = None


def kept_knnper(root: str | Path | None, node_key: str, run_id: int | None = None) -> personal.Kept | None:
    """The kept kNN-Per model `datastore add` grows: run `run_id`'s (an error if that run's is
    another strategy's), else the latest kNN-Per model of the node, even when a later run of
    another strategy kept one since; None when the node keeps none."""
    if run_id is not None:
        kept = personal.find(root, node_key, run_id)
        if kept.manifest.get("strategy") != KNNPER.name:
            raise ValueError(
                f"node {node_key}'s model of run {run_id} ({kept.folder}) is strategy "
                f"{kept.manifest.get('strategy')!r}'s, not knnper's: it has no datastore to add to"
            )
        return kept
    found = [k for k in personal.kept_models(root, node_key) if k.manifest.get("strategy") == KNNPER.name]
    return found[-1] if found else None


def _state_target(state: NodeState) -> _Target | None:
    """The node's datastore in its state folder (what its next run reuses), with the global
    model it was built with; None when there is none yet."""
    store, weights = Datastore.load(state), state.load_arrays(GLOBAL_MODEL)
    if store is None or weights is None:
        return None
    shape, classes = tuple(store.meta["input_shape"]), int(store.meta["num_classes"])
    model = build_model(store.meta["model"], shape, classes)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    return _Target("datastore", store, model.eval(), shape, classes, lambda x, y: store.save(state))


def _kept_target(kept: personal.Kept) -> _Target:
    """A kept model's store, under the policy and capacity of the run that kept it, with the
    kept network: it embedded the store's entries and embeds every query `predict` makes."""
    extras, run = kept.extras(), kept.manifest.get("run_config", {})
    if "embeddings" not in extras or "labels" not in extras:
        raise ValueError(f"{kept.folder / personal.EXTRAS}: no kNN-Per datastore (embeddings, labels) in it")
    embeddings = extras["embeddings"]
    capacity, policy = int(run.get("knn-capacity", 0)), str(run.get("knn-policy", "concat"))
    store = Datastore(embeddings.shape[1], kept.manifest["knn"]["index"], capacity, policy)
    store.add(embeddings, extras["labels"])  # kept under this policy already: nothing is evicted
    before = len(store)

    def save(x: np.ndarray, y: np.ndarray) -> None:
        """extras.npz, then the manifest, each replaced whole; the accuracy the run reported stays."""
        atomic_write(
            kept.folder / personal.EXTRAS,
            lambda f: np.savez(f, **extras | {"embeddings": store.embeddings, "labels": store.labels}),
        )
        record = {"count": len(y), "data": train_fingerprint(x, y), "before": before, "after": len(store)}
        manifest = kept.manifest | {"added": [*kept.manifest.get("added", []), record | {"saved": time.time()}]}
        personal.write_manifest(kept.folder, manifest)

    return _Target("kept", store, kept.network(), kept.input_shape, kept.num_classes, save, kept)


def _folder_samples(
    data_dir: str, num_classes: int, input_shape: tuple[int, ...], seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """The labelled samples of a folder's train split, (x, y), checked against the model's input."""
    new = folders.folder_client(data_dir, num_classes, seed, val_fraction=0.5)
    if not new.labelled:
        raise ValueError(f"{data_dir}: datastore entries need labels (array y)")
    if new.input_shape != input_shape:
        raise ValueError(
            f"{data_dir}: samples have shape {new.input_shape}, the datastore's model expects {input_shape}"
        )
    # Every labelled sample but a test set of the folder's own (test.npz, test/): the loader
    # carves validation (and, from a folder of class folders or train/ alone, test) out of them.
    own_test = (Path(data_dir) / "test.npz").exists() or (Path(data_dir) / "test").is_dir()
    parts = [(new.x_train, new.y_train), (new.x_val, new.y_val)] + ([] if own_test else [(new.x_test, new.y_test)])
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])


def add_samples(state: NodeState, data_dir: str, kept: personal.Kept | None = None, seed: int = 0) -> list[Grown]:
    """Add the labelled samples of a folder's train split, without retraining, to the node's
    datastore (`state`: what its next run reuses) and to the store of the kept model `kept`
    (what `florist predict` uses now), each embedded with the network it was built with and
    under the run's capacity policy. Everything is checked and embedded before either store is
    written. The folder's test split is never added: test points in a store would find
    themselves, with their true labels."""
    targets = [t for t in (_state_target(state), kept and _kept_target(kept)) if t is not None]
    if not targets:
        raise FileNotFoundError(
            f"node {state.key} has no kNN-Per datastore in {state.folder / state.namespace} and keeps no kNN-Per "
            f"model in {state.folder / personal.MODELS}: both are built the first time the node is evaluated with "
            "strategy knnper"
        )
    grown, samples = [], {}
    for target in targets:
        where = (target.num_classes, target.input_shape)
        if where not in samples:
            samples[where] = _folder_samples(data_dir, *where, seed)
        before = len(target.store)
        target.store.add(training.embed(target.model, samples[where][0]), samples[where][1])
        grown.append(Grown(target.name, before, len(target.store), target.kept))
    for target in targets:
        target.save(*samples[target.num_classes, target.input_shape])
    return grown
