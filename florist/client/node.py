"""Everything a client handler needs about its node: settings, data, identity, state folder.

Settings come from three layers: florist's defaults, the run config (`flwr run`), and the
`config` record of the message (what florist's server sends). Data and identity come from
`--node-config`: `data-dir` for a node's own folder, else the embedded digits partition
`partition-id` of `num-partitions`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import zlib

import numpy as np
import torch
from flwr.app import Context, Message, RecordDict

from florist.client.state import NodeState
from florist.common import data as data_lib
from florist.common import protocol, training
from florist.common.config import RunConfig
from florist.common.models import Net, build_model


@dataclasses.dataclass
class Node:
    """The client side of one message: who this node is, its settings and its data."""

    key: str
    seen: bool
    cfg: RunConfig
    data: data_lib.ClientData
    state: NodeState
    server_round: int
    node_config: dict

    def new_model(self) -> Net:
        """The run's model, initialised exactly as the server initialises the global one."""
        torch.manual_seed(self.cfg.seed)
        return build_model(self.cfg.model, self.data.input_shape, self.cfg.num_classes)

    def fit(self, model: Net, epochs: int, lr: float | None = None, salt: int = 0, **options) -> float:
        """Train `model` on this node's train split with the run's settings (`options` override
        `training.train`'s, e.g. `steps`); the shuffling is seeded by (seed, round, node, salt)
        so the same seed repeats the same run."""
        if not self.data.labelled:
            raise ValueError(f"node {self.key}: this strategy needs labelled data, but the node's data has no y")
        cfg, d = self.cfg, self.data
        generator = training.seeded_generator(cfg.seed, self.server_round, zlib.crc32(self.key.encode()), salt)
        settings = {"epochs": epochs, "batch_size": cfg.batch_size, "lr": lr or cfg.lr, "momentum": cfg.momentum,
                    "weight_decay": cfg.weight_decay, "generator": generator}  # fmt: skip
        return training.train(model, d.x_train, d.y_train, **settings | options)

    def test_reply(self, model: Net, **extra: float) -> RecordDict:
        """The standard evaluate reply: accuracy and loss of `model` on this node's test split."""
        return self.score_reply(training.predict_proba(model, self.data.x_test), **extra)

    def score_reply(self, probs: np.ndarray, **extra: float) -> RecordDict:
        """The standard evaluate reply for test-split class probabilities (N_test×C). With
        `mask-classes`, `masked-accuracy` (only the classes of the train split may win) rides
        beside the honest all-class `accuracy`."""
        d = self.data
        if d.y_test is None:
            raise ValueError(f"node {self.key}: cannot score a model without test labels")
        accuracy, loss = float((probs.argmax(1) == d.y_test).mean()), training.log_loss(probs, d.y_test)
        if self.cfg.mask_classes and d.labelled:  # opt-in: the score PeFLL's reference code reports
            present = np.bincount(d.y_train, minlength=probs.shape[1]) > 0
            extra = {"masked-accuracy": float(((probs * present).argmax(1) == d.y_test).mean())} | extra
        metrics = {"num-examples": len(d.x_test), "num-train": len(d.x_train), "seen": int(self.seen)}
        return protocol.content(metrics=metrics | {"accuracy": accuracy, "loss": loss} | extra)


def settings(msg: Message, context: Context) -> RunConfig:
    """Defaults ← run config ← the message's `config` record (unknown keys are ignored,
    e.g. Flower's `server-round`)."""
    known = set(RunConfig().to_mapping())
    layers = dict(context.run_config)
    if protocol.CONFIG in msg.content.config_records:
        layers.update(msg.content.config_records[protocol.CONFIG])
    return RunConfig.from_mapping({k: v for k, v in layers.items() if k in known})


def node_of(msg: Message, context: Context) -> Node:
    cfg = settings(msg, context)
    node_config = context.node_config
    server_round = 0
    if protocol.CONFIG in msg.content.config_records:
        server_round = int(msg.content.config_records[protocol.CONFIG].get("server-round", 0))
    if "data-dir" in node_config:
        data_dir = str(node_config["data-dir"])
        client = _cached_folder(data_dir, cfg.num_classes, cfg.seed, cfg.val_fraction)
        default_key = re.sub(r"[^A-Za-z0-9._-]", "-", data_dir.strip("/")).strip("-.")[-64:] or "node"
        seen = not bool(node_config.get("unseen", False))
    else:
        pid, num = int(node_config["partition-id"]), int(node_config["num-partitions"])
        client = data_lib.embedded_client(
            pid, num, cfg.partition, cfg.seed, cfg.val_fraction, cfg.test_fraction, cfg.min_partition_size,
            public_size=cfg.public_size,
        )
        default_key = f"partition-{pid}"
        seen = pid not in data_lib.unseen_partitions(num, cfg.unseen_fraction, cfg.seed)
    key = str(node_config.get("node-key", default_key))
    return Node(key, seen, cfg, client, NodeState(node_config.get("state-dir"), key), server_round, dict(node_config))


@functools.lru_cache(maxsize=4)
def _cached_folder(data_dir: str, num_classes: int, seed: int, val_fraction: float) -> data_lib.ClientData:
    return data_lib.folder_client(data_dir, num_classes, seed, val_fraction)

