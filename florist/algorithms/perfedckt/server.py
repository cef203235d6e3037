"""PerFed-CKT (Cho, Wang, Chiruvolu, Joshi, 2021), server half: sample clients in proportion
to their data, send them the centroids of the last round's soft decisions on the public set P,
and cluster the soft decisions they return with faiss k-means. The server never sees a weight,
so clients may run different architectures, and a round costs c·|P|·C floats down and |P|·C
up per client whatever the models' size (`client/perfedckt.py` has the client half)."""

from __future__ import annotations

import re
from typing import Any

import faiss
import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict

from florist.client.perfedckt import CENTROIDS, SOFT
from florist.common import data as data_lib
from florist.common import protocol
from florist.common.config import RunConfig
from florist.strategies.base import TESTED, TRAINED, NodeInfo, Strategy, mean_loss, metrics_of
from florist.strategies.fedavg import exchange_bytes


def public_fingerprint(cfg: RunConfig) -> str:
    """The fingerprint of P every node must match: `public-hash` when given, else that of
    `public-dir` read here, else that of the embedded digits' public slice."""
    if cfg.public_hash:
        if not re.fullmatch(r"[1-9][0-9]*-[0-9a-f]{16}", cfg.public_hash):
            raise ValueError(f"public-hash {cfg.public_hash!r} is not a fingerprint like '200-0123456789abcdef' "
                             "(`florist public-hash DIR` prints it)")  # fmt: skip
        return cfg.public_hash
    if cfg.public_dir:
        try:
            return data_lib.fingerprint(data_lib.folder_public(cfg.public_dir, cfg.num_classes))
        except FileNotFoundError as err:
            raise FileNotFoundError(f"{err}. If P is only on the nodes, set public-hash to what "
                                    "`florist public-hash DIR` prints there") from err  # fmt: skip
    return data_lib.fingerprint(data_lib.embedded_public(cfg.public_size, cfg.seed))


def cluster(points: np.ndarray, clusters: int, seed: int) -> np.ndarray:
    """k-means centroids of the rows of `points`: min(`clusters`, rows) of them, every point
    used (no subsampling), deterministic for a seed."""
    k = min(clusters, len(points))
    kmeans = faiss.Kmeans(points.shape[1], k, niter=25, seed=seed, verbose=False,
                          min_points_per_centroid=1, max_points_per_centroid=len(points))  # fmt: skip
    kmeans.train(np.ascontiguousarray(points, dtype=np.float32))
    return kmeans.centroids.copy()


class PerFedCKT(Strategy):
    name = "perfed-ckt"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.public_hash = public_fingerprint(self.cfg)
        self.soft_shape = (int(self.public_hash.split("-")[0]), self.cfg.num_classes)
        self.centroids: np.ndarray | None = None  # c × |P| × C, none before the first round
        self.trained: set[int] = set()  # nodes that own a model of this run
        self.participations = 0  # training replies so far
        self.fedavg_exchange = exchange_bytes(self.new_model(), self.client_config(0))
        self.extras: dict[str, Any] = {}

    def sample(self, nodes: list[NodeInfo], server_round: int) -> list[NodeInfo]:
        """`sample_size` nodes drawn without replacement with probability ∝ their data size."""
        sizes = np.array([n.num_train for n in nodes], dtype=float)
        rng = np.random.default_rng([self.cfg.seed, server_round])
        picked = rng.choice(len(nodes), self.sample_size(len(nodes)), replace=False, p=sizes / sizes.sum())
        return [nodes[i] for i in sorted(picked)]

    def request(self, server_round: int, centroids: bool, **extra: Any) -> RecordDict:
        """The settings with P's fingerprint, and the centroids when asked for and there are some."""
        arrays = None
        if centroids and self.centroids is not None:
            arrays = ArrayRecord({CENTROIDS: torch.from_numpy(self.centroids)})
        return protocol.content(arrays, self.client_config(server_round, public_hash=self.public_hash, **extra))

    def train_round(self, server_round: int, nodes: list[NodeInfo]) -> float | None:
        fed = self.federation
        before = fed.bytes_up, fed.bytes_down
        reference = {SOFT: torch.zeros(self.soft_shape)}
        replies = self.broadcast(nodes, protocol.TRAIN_CKT, server_round, self.request(server_round, True), TRAINED,
                                 reference)  # fmt: skip
        fedavg_up, fedavg_down = self.fedavg_exchange
        self.extras = {"train_bytes_up": fed.bytes_up - before[0], "train_bytes_down": fed.bytes_down - before[1],
                       "fedavg_bytes_up": fedavg_up * len(replies), "fedavg_bytes_down": fedavg_down * len(nodes)}
        done = [replies[n.node_id] for n in nodes if n.node_id in replies]  # fixed order: same seed, same centroids
        if done:
            points = np.stack([r.arrays[SOFT].numpy().reshape(-1) for r in done])
            seed = self.cfg.seed * 100_003 + server_round
            self.centroids = cluster(points, self.cfg.ckt_clusters, seed).reshape(-1, *self.soft_shape)
        self.trained.update(replies)
        self.participations += len(replies)
        return mean_loss(r.metrics for r in done)

    def evaluate(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        """Each node tests its own model. After training, a node without one (never sampled,
        held out, or joining late) gets the centroids and first trains its model for as many
        rounds as a seen node took part in on average."""
        plain = self.request(server_round, False)
        scratch = plain
        if server_round > self.cfg.num_server_rounds:
            rounds = max(1, round(self.participations / self.num_seen))
            scratch = self.request(server_round, True, scratch_rounds=rounds)
        requests = {n.node_id: plain if n.node_id in self.trained else scratch for n in nodes}
        return metrics_of(self.ask(requests, protocol.EVALUATE_CKT, server_round, TESTED))

    def state(self) -> dict[str, torch.Tensor]:
        return {} if self.centroids is None else {"centroids": torch.from_numpy(self.centroids)}

    def round_extras(self) -> dict[str, Any]:
        return self.extras
