"""PerFed-CKT's server half: sample clients in proportion to their data, send them the
centroids of the last round's soft decisions on the public set P, and cluster the soft
decisions they return with faiss k-means. The server never sees a weight, so a round costs
c·|P|·C floats down and |P|·C up per client whatever the models' size."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict

from florist.common import data as data_lib
from florist.common import folders, protocol
from florist.common.metrics import summarize
from florist.common.models import build_model
from florist.config import RunConfig
from florist.server.report import pct
from florist.server.strategy import TESTED, NodeInfo, ServerStrategy, mean_loss, metrics_of
from florist.strategies.fedavg.server import exchange_bytes
from florist.strategies.fedavg.spec import TRAIN
from florist.strategies.perfedckt import public as public_lib
from florist.strategies.perfedckt.spec import CENTROIDS, EVALUATE_CKT, SOFT, TRAIN_CKT, CktSettings


def public_fingerprint(cfg: RunConfig, input_shape: tuple[int, ...]) -> str:
    """The fingerprint of P every node must match: `public-hash` when given, else that of
    `public-dir` read here, else that of the run's `public-dataset` at the clients' `input_shape`."""
    ckt, num_classes = cfg.settings, cfg.num_classes
    if ckt.public_hash:
        if not re.fullmatch(r"[1-9][0-9]*-[0-9a-f]{16}", ckt.public_hash):
            raise ValueError(
                f"public-hash {ckt.public_hash!r} is not a fingerprint like '200-0123456789abcdef' "
                "(`florist public-hash DIR` prints it)"
            )
        return ckt.public_hash
    if ckt.public_dir:
        try:
            return data_lib.fingerprint(folders.folder_public(ckt.public_dir, num_classes))
        except FileNotFoundError as err:
            raise FileNotFoundError(
                f"{err}. If P is only on the nodes, set public-hash to what `florist public-hash DIR` prints there"
            ) from err
    return data_lib.fingerprint(public_lib.public_set(cfg, input_shape))


def cluster(points: np.ndarray, clusters: int, seed: int) -> np.ndarray:
    """k-means centroids of the rows of `points`: min(`clusters`, rows) of them, every point
    used (no subsampling), deterministic for a seed."""
    k = min(clusters, len(points))
    kmeans = faiss.Kmeans(
        points.shape[1],
        k,
        niter=25,
        seed=seed,
        verbose=False,
        min_points_per_centroid=1,
        max_points_per_centroid=len(points),
    )
    kmeans.train(np.ascontiguousarray(points, dtype=np.float32))
    return kmeans.centroids.copy()


class PerFedCKT(ServerStrategy):
    settings: CktSettings
    # Under record-level dp (its spec's `record_covered`) a node's model is DP-SGD's (the distillation term reads
    # only P and the centroids, no record of the node's); its soft decisions on P and its cluster are
    # post-processing of it.

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        for name in filter(None, (n.strip() for n in self.settings.client_models.split(","))):
            build_model(name, self.input_shape, cfg.num_classes)  # a wrong name or shape fails here, not on a node
            if cfg.record_dp and name == "mobilenet_v2":
                raise ValueError(
                    f'dp = "{cfg.dp}" needs per-sample gradients, and client-models\' mobilenet_v2 has BatchNorm, '
                    "which mixes the samples of a batch"
                )
        self.public_hash = public_fingerprint(cfg, tuple(self.input_shape))
        self.soft_shape = (int(self.public_hash.split("-")[0]), self.cfg.num_classes)
        self.centroids: np.ndarray | None = None  # c × |P| × C, none before the first round
        self.trained: set[str] = set()  # keys of the nodes that own a model of this run
        self.participations = 0  # training replies so far
        self.fedavg_exchange = exchange_bytes(self.new_model(), protocol.message_config(cfg, TRAIN, 0, 0))
        self.extras: dict[str, Any] = {}

    def sample(self, nodes: list[NodeInfo], server_round: int) -> list[NodeInfo]:
        """`sample_size` nodes drawn without replacement with probability ∝ their data size."""
        sizes = np.array([n.num_train for n in nodes], dtype=float)
        rng = np.random.default_rng([self.cfg.seed, server_round])
        picked = rng.choice(len(nodes), self.sample_size(len(nodes)), replace=False, p=sizes / sizes.sum())
        return [nodes[i] for i in sorted(picked)]

    def ckt_request(self, exchange, server_round: int, centroids: bool, scratch_rounds: int = 0) -> RecordDict:
        """A request with P's fingerprint, and the centroids when asked for and there are some."""
        arrays = None
        if centroids and self.centroids is not None:
            arrays = ArrayRecord({CENTROIDS: torch.from_numpy(self.centroids)})
        return self.request(exchange, server_round, arrays, public_hash=self.public_hash, scratch_rounds=scratch_rounds)

    def train_round(self, server_round: int, nodes: list[NodeInfo]) -> float | None:
        fed = self.exchanger
        before = fed.bytes_up, fed.bytes_down
        reference = {SOFT: torch.zeros(self.soft_shape)}
        request = self.ckt_request(TRAIN_CKT, server_round, True)
        replies = self.broadcast(TRAIN_CKT, nodes, server_round, request, self.trained_metrics, reference)
        fedavg_up, fedavg_down = self.fedavg_exchange
        self.extras = {
            "train_bytes_up": fed.bytes_up - before[0],
            "train_bytes_down": fed.bytes_down - before[1],
            "fedavg_bytes_up": fedavg_up * len(replies),
            "fedavg_bytes_down": fedavg_down * len(nodes),
        }
        done = [replies[n.node_id] for n in nodes if n.node_id in replies]  # fixed order: same seed, same centroids
        if done:
            points = np.stack([r.arrays[SOFT].numpy().reshape(-1) for r in done])
            seed = self.cfg.seed * 100_003 + server_round
            self.centroids = cluster(points, self.settings.clusters, seed).reshape(-1, *self.soft_shape)
        self.trained.update(n.key for n in nodes if n.node_id in replies)
        self.participations += len(replies)
        return mean_loss(r.metrics for r in done)

    def evaluate(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        """Each node tests its own model. While training runs, only nodes that have one are
        asked (an untrained model says nothing about the method). After training, a node without
        one (never sampled, held out, or joining late) gets the centroids and first trains its
        model for as many rounds as a seen node took part in on average."""
        plain = self.ckt_request(EVALUATE_CKT, server_round, False)
        scratch = plain
        if server_round <= self.cfg.num_server_rounds:
            nodes = [n for n in nodes if n.key in self.trained]
        else:
            rounds = max(1, round(self.participations / self.num_seen))
            scratch = self.ckt_request(EVALUATE_CKT, server_round, True, scratch_rounds=rounds)
        requests = {n.node_id: plain if n.key in self.trained else scratch for n in nodes}
        return metrics_of(self.ask(EVALUATE_CKT, requests, server_round, TESTED))

    def state(self) -> dict[str, Any]:
        centroids = None if self.centroids is None else torch.from_numpy(self.centroids)
        return {"centroids": centroids, "trained": sorted(self.trained), "participations": self.participations}

    def load_state(self, state: dict[str, Any]) -> None:
        self.centroids = None if state["centroids"] is None else state["centroids"].numpy()
        self.trained, self.participations = set(state["trained"]), state["participations"]

    def round_extras(self) -> dict[str, Any]:
        return self.extras


def report(results: dict[str, Any], folder: Path) -> list[str]:
    """Traffic beside FedAvg's, and accuracy per client architecture."""
    return _communication(results) + _per_model(results)


def _communication(results: dict[str, Any]) -> list[str]:
    """Training traffic per round beside FedAvg's for the same clients and model, when the
    strategy measured it (PerFed-CKT)."""
    rounds = [r for r in results["rounds"] if "fedavg_bytes_up" in r]
    if not rounds:
        return []
    mean = lambda key: sum(r[key] for r in rounds) / len(rounds) / 1e3  # noqa: E731
    ours, fedavg = (
        mean("train_bytes_up") + mean("train_bytes_down"),
        mean("fedavg_bytes_up") + mean("fedavg_bytes_down"),
    )
    return [
        "",
        f"Training traffic per round: {mean('train_bytes_up'):,.1f} kB up and {mean('train_bytes_down'):,.1f} kB "
        f"down. FedAvg with the same clients and model `{results['config']['model']}` would send "
        f"{mean('fedavg_bytes_up'):,.1f} kB up and {mean('fedavg_bytes_down'):,.1f} kB down: "
        f"{fedavg / ours:,.0f}× as much.",
    ]


def _per_model(results: dict[str, Any]) -> list[str]:
    """Accuracy per client model, when clients ran models of different sizes."""
    clients = [c for c in results["clients"] if c.get("num_params") is not None and c["accuracy"] is not None]
    sizes = sorted({c["num_params"] for c in clients})
    if len(sizes) < 2:
        return []
    lines = [
        "",
        "Accuracy per client model:",
        "",
        "| parameters | clients | mean acc. (%) | bottom decile (%) |",
        "|---:|---:|---:|---:|",
    ]
    for size in sizes:
        rows = [c for c in clients if c["num_params"] == size]
        s = summarize([c["accuracy"] for c in rows], [c["num_test"] for c in rows])
        lines.append(
            f"| {size:,} | {s['num_clients']} | {pct(s['mean_accuracy'])} | {pct(s['bottom_decile_accuracy'])} |"
        )
    return lines


PerFedCKT.report = staticmethod(report)  # its section of report.md
