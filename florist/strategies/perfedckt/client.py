"""PerFed-CKT's client half: the node owns its model, whose architecture may differ from every
other node's, and only soft decisions on P travel. The distillation sum is estimated on
mini-batches of P. The model lives in the node's state folder, tagged with its run, round and
architecture: a sampled node continues from its last model, a new run starts afresh."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict

from florist.client.node import Node, Request
from florist.common import data as data_lib
from florist.common import folders, protocol, training
from florist.common.models import Net
from florist.strategies.perfedckt import public as public_lib
from florist.strategies.perfedckt.spec import CENTROIDS, SOFT

MODEL = "model"


def architecture(node: Node) -> str:
    """Node config `model`, else the node's entry in `client-models` (by partition id,
    cycling), else the run's `model`."""
    if "model" in node.node_config:
        return str(node.node_config["model"])
    names = [n.strip() for n in node.cfg.settings.client_models.split(",") if n.strip()]
    if names and "partition-id" in node.node_config:
        return names[int(node.node_config["partition-id"]) % len(names)]
    return node.cfg.model


def public_set(node: Node, expected: str) -> np.ndarray:
    """This node's copy of P, refused unless its fingerprint is the server's `expected` one."""
    folder = node.cfg.settings.public_dir
    if folder:
        x, source = folders.folder_public(folder, node.cfg.num_classes), f"public-dir {folder!r}"
    else:
        x, source = (
            public_lib.public_set(node.cfg, node.data.input_shape),
            f"public-dataset {node.cfg.settings.public_dataset!r}",
        )
    found = data_lib.fingerprint(x)
    if found != expected:
        raise ValueError(
            f"node {node.key}: its public set P (from {source}) has fingerprint {found}, but the server expects "
            f"{expected}. Every node must hold the same P: check public-dir, public-dataset, public-size and seed"
        )
    if x.shape[1:] != node.data.input_shape:
        raise ValueError(f"node {node.key}: P has samples of shape {x.shape[1:]}, its data {node.data.input_shape}")
    return x


def _soft(node: Node, logits: torch.Tensor) -> torch.Tensor:
    """s(w, x): the class probabilities (the paper's s ∈ Δ_N), or the logits with `ckt-soft = "logits"`."""
    return logits.softmax(1) if node.cfg.settings.soft == "probs" else logits


def soft_decisions(node: Node, model: Net, public: np.ndarray) -> np.ndarray:
    """s(w, x) for every x in P, |P|×C."""
    return _soft(node, torch.from_numpy(training.predict_logits(model, public, device=node.device))).numpy()


def nearest_centroid(soft: np.ndarray, centroids: np.ndarray) -> int:
    """Index of the centroid closest to `soft` (|P|×C) in squared L2 distance over all of P."""
    return int(((centroids - soft[None]) ** 2).reshape(len(centroids), -1).sum(1).argmin())


def distillation_loss(logits: torch.Tensor, targets: torch.Tensor, lam: float) -> torch.Tensor:
    """λ/|B|·Σ_{x∈B} ‖s̄(x) − s(w, x)‖² over a batch B of P: the paper's term, per sample."""
    return lam * ((targets - logits) ** 2).sum(1).mean()


def _owned_model(node: Node, up_to: int) -> tuple[Net, dict | None]:
    """The node's model as of round `up_to` and its record (None, with a fresh model, when it
    has none for this run and architecture)."""
    name = architecture(node)
    model, kept = node.new_model(name), node.state.load_round(MODEL, node.run_id, up_to)
    if kept is None or kept[1].get("model") != name:
        return model, None
    model.load_state_dict({k: torch.from_numpy(v) for k, v in kept[0].items()})
    return model, kept[1]


def _save(node: Node, model: Net, **meta) -> None:
    arrays = {k: v.numpy() for k, v in model.state_dict().items()}
    node.state.save_round(MODEL, arrays, node.run_id, node.server_round, model=architecture(node), **meta)


def _centroids(node: Node, content: RecordDict, public: np.ndarray) -> np.ndarray | None:
    """The centroids the server sent (None in round one), checked against P's shape."""
    if protocol.ARRAYS not in content.array_records:
        return None
    sent = content.array_records[protocol.ARRAYS].to_torch_state_dict().get(CENTROIDS, torch.zeros(0)).numpy()
    expected = (len(public), node.cfg.num_classes)
    if sent.ndim != 3 or sent.shape[1:] != expected or not np.isfinite(sent).all():
        raise protocol.ProtocolError(
            f"node {node.key}: the server's centroids have shape {sent.shape}, "
            f"expected c×{expected[0]}×{expected[1]} finite values"
        )
    return sent


def _fit(node: Node, model: Net, public: np.ndarray, centroids: np.ndarray | None, salt: int) -> tuple[float, int]:
    """τ local steps; with centroids, distilled toward the nearest one. Returns (loss, cluster)."""
    cfg, penalty, cluster = node.cfg, None, -1
    if centroids is not None:
        cluster = nearest_centroid(soft_decisions(node, model, public), centroids)
        penalty = _distillation(node, public, centroids[cluster], salt)
    loss = node.fit(model, cfg.local_epochs, salt=salt, steps=cfg.settings.steps or None, penalty=penalty)
    return loss, cluster


def _distillation(node: Node, public: np.ndarray, target: np.ndarray, salt: int) -> Callable[[Net], torch.Tensor]:
    """The distillation term on a fresh mini-batch of P at every call (seeded like `Node.fit`)."""
    order = training.batches(len(public), node.cfg.settings.public_batch, node.generator(salt, 1))
    s_bar = torch.from_numpy(target)

    def penalty(model: Net) -> torch.Tensor:
        batch, device = next(order), next(model.parameters()).device
        soft = _soft(node, model(training.inputs(public[batch.numpy()], device)))
        return distillation_loss(soft, s_bar[batch].to(device), node.cfg.settings.lambda_)

    return penalty


def train(node: Node, request: Request) -> RecordDict:
    """One round of Algorithm 1 on this node; its model stays here, its soft decisions go up."""
    public = public_set(node, request.settings.public_hash)
    model, meta = _owned_model(node, node.server_round - 1)
    loss, cluster = _fit(node, model, public, _centroids(node, request.content, public), salt=0)
    rounds = (meta or {}).get("rounds", 0) + 1
    _save(node, model, rounds=rounds, cluster=cluster)
    soft = torch.from_numpy(soft_decisions(node, model, public))
    metrics = {"num-examples": len(node.data.x_train), "cluster": cluster}
    if not node.cfg.record_dp:  # under record-level dp the loss (un-noised) stays; the cluster is the DP model's
        metrics["train-loss"] = loss
    return protocol.content(ArrayRecord({SOFT: soft}), metrics=metrics)


def evaluate(node: Node, request: Request) -> RecordDict:
    """Test the node's own model. A node without one (never sampled, or held out) tests a fresh
    model while training runs; when the server says `scratch-rounds` (the final evaluation and
    the serve phase) it trains one first, as a seen node did over that many rounds: local
    training, then distillation toward the nearest of the final centroids (`ckt-unseen =
    paper`: distilled from its first round on, as Algorithm 1 trains a client first sampled
    after round one, its centroid picked by its fresh model)."""
    model, meta = _owned_model(node, node.server_round)
    if meta is None and request.settings.scratch_rounds > 0:
        rounds = request.settings.scratch_rounds  # each a round's `_fit`: refused before the first if too many steps
        node.check_steps(rounds * node.local_steps(node.cfg.local_epochs, node.cfg.settings.steps or None))
        public = public_set(node, request.settings.public_hash)
        centroids, cluster = _centroids(node, request.content, public), -1
        paper = node.cfg.settings.unseen == "paper"  # as Algorithm 1 treats a client first sampled after round one
        for i in range(rounds):
            _, cluster = _fit(node, model, public, centroids if i or paper else None, salt=2 + i)
        meta = {"rounds": 0, "cluster": cluster}
        _save(node, model, **meta)
    params = sum(p.numel() for p in model.parameters())
    record = meta or {"rounds": 0, "cluster": -1}
    return node.test_reply(
        model, **{"num-params": params, "rounds-trained": record["rounds"], "cluster": record["cluster"]}
    )
