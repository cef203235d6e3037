"""Everything a client handler gets: its `Node` (who it is, the run's settings, its data and
state) and the `Request` (the exchange's own settings and the message's records).

Settings come from the message's `config` record when florist's server sent it: then every key
must be one this strategy and exchange declare, and none may be missing, so a typo on either
side fails loudly instead of becoming a default. A standard `train`/`evaluate` message from one
of Flower's own strategies carries no florist settings: the run config is used, with the keys
it shares with the message's config. Data and identity come from `--node-config`: `data-dir`
for a node's own folder, else the embedded digits partition `partition-id` of `num-partitions`.
Folders (`dataset`, `public-dir`) come from the node config too, and what one message may ask
of the node is capped by it (`client/guard.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from flwr.app import Context, Message, RecordDict

from florist.client import guard, personal
from florist.client.state import NodeState
from florist.common import classnames, datacache, devices, folders, protocol, scenarios, training
from florist.common import data as data_lib
from florist.common.models import Net, seeded_model
from florist.common.settings import Settings, coerce
from florist.common.spec import Exchange, StrategySpec
from florist.config import RunConfig

log = logging.getLogger("flwr").getChild(__name__)  # in the node's log, beside Flower's


@dataclasses.dataclass(frozen=True)
class Request:
    """What one message asks: the exchange's own settings and the records it carries."""

    settings: Settings
    content: RecordDict

    @property
    def from_flower(self) -> bool:
        """Whether one of Flower's own strategies sent it (florist's server names its strategy)."""
        return "strategy" not in self.content.config_records.get(protocol.CONFIG, {})


@dataclasses.dataclass
class Node:
    """The client side of one message: who this node is, its settings, data and state."""

    key: str
    seen: bool
    run_id: int  # what this node keys its state of the run by (the same for a resumed run)
    server_round: int
    cfg: RunConfig  # `cfg.settings`: the strategy's section, with this node's overrides
    data: data_lib.ClientData
    state: NodeState
    node_config: dict
    flower_driven: bool = False  # one of Flower's own strategies sent the message
    # Flower's own id of the run, which no message config can change: what the privacy ledger and the kept models key by
    flower_run_id: int = 0
    steps_taken: int = 0  # local optimizer steps this message has taken so far (`fit`)
    # record-level dp: this message's ledger and what the reply tells of it, shared by the node's copies
    record_session: dict = dataclasses.field(default_factory=dict)

    @property
    def final_evaluation(self) -> bool:
        """Whether this evaluation is the run's last (or the serve phase's after it): florist's
        server evaluates once more after the last round (num-server-rounds + 1), Flower's own
        strategies in the last round itself."""
        return self.server_round > self.cfg.num_server_rounds - self.flower_driven

    def new_model(self, name: str = "") -> Net:
        """The run's model (or `name`), initialised exactly as the server initialises it."""
        return seeded_model(name or self.cfg.model, self.data.input_shape, self.cfg.num_classes, self.cfg.seed)

    def received_model(self, request: Request) -> Net:
        """The model sent under `arrays`, checked against this run's architecture (converted to
        its dtypes when one of Flower's strategies sent it)."""
        model = self.new_model()
        source = f"node {self.key}: the server's message"
        sent = protocol.arrays_of(request.content, model.state_dict(), source, convert=request.from_flower)
        model.load_state_dict(sent)
        return model

    @functools.cached_property
    def limits(self) -> guard.Limits:
        """What one message may ask of this node (`node-max-*` in its `--node-config`)."""
        return guard.Limits.of(self.node_config)

    def local_steps(self, epochs: int, steps: int | None = None) -> int:
        """The optimizer steps `fit(model, epochs, steps=steps)` takes on this node's train split."""
        return steps if steps is not None else epochs * math.ceil(len(self.data.x_train) / self.cfg.batch_size)

    def check_steps(self, count: int) -> None:
        """Refuse, before any of them is taken, `count` more local steps than this message's
        cap (`node-max-steps`) allows."""
        self.limits.check_steps(self.steps_taken + count, f"node {self.key}")

    @functools.cached_property
    def device(self) -> torch.device:
        """Where this node trains and predicts (`device`, a node's `--node-config` first)."""
        return devices.resolve(self.cfg.device, f"node {self.key}: device")

    def fit(
        self, model: Net, epochs: int, lr: float | None = None, salt: int = 0, private: bool = True, **options
    ) -> float:
        """Train `model` on this node's train split with the run's settings (`options` override
        `training.train`'s, e.g. `steps`) on the node's device; the shuffling (and `augment`)
        is seeded by (seed, round, node, salt) so the same seed repeats the same run. Under
        record-level dp, and unless `private` is False (a model that never leaves the node: FedAvg+'s
        fine-tuning, Local's), DP-SGD (`fit_private`)."""
        if not self.data.labelled:
            raise ValueError(f"node {self.key}: this strategy needs labelled data, but the node's data has no y")
        cfg, d = self.cfg, self.data
        count = self.local_steps(epochs, options.get("steps"))
        self.check_steps(count)
        augment = training.augmenter(cfg.augment, d.input_shape, *self.seed(salt, 0xA6))
        if cfg.record_dp and private:
            return self.fit_private(model, count, lr, augment, options, salt)
        self.steps_taken += count
        settings = {
            "epochs": epochs,
            "batch_size": cfg.batch_size,
            "lr": lr or cfg.lr,
            "momentum": cfg.momentum,
            "weight_decay": cfg.weight_decay,
            "generator": self.generator(salt),
            "augment": augment,
            "device": self.device,
        }
        return training.train(model, d.x_train, d.y_train, **settings | options)

    def fit_private(self, model: Net, count: int, lr: float | None, augment, options: dict, salt: int = 0) -> float:
        """`count` DP-SGD steps (fewer when the ledger allows fewer; florist/client/ledger.py counts
        them before the first is taken): Poisson samples at q = batch-size / n, each record's gradient
        clipped to dp-clip, N(0, (σ·dp-clip)²) per step, the sum over batch-size (training.train_private)."""
        from florist.client import ledger  # it imports this module

        book = ledger.record_ledger(self)
        if book.available < count:
            book.reserve(count - book.available, len(self.data.x_train), per_round=count)
        steps = book.take(count)
        self.steps_taken += steps
        cfg, d = self.cfg, self.data
        sampler, noise = self.private_generators(0x5D, salt, self.steps_taken)
        settings = {
            "steps": steps,
            "rate": book.q,
            "clip": cfg.dp_clip,
            "sigma": book.sigma,
            "batch_size": cfg.batch_size,
            "lr": lr or cfg.lr,
            "momentum": cfg.momentum,
            "weight_decay": cfg.weight_decay,
            "sampler": sampler,
            "noise": noise,
            "augment": augment,
            "device": self.device,
        }
        extra = {key: value for key, value in options.items() if key != "steps"}  # `count` took them
        return training.train_private(model, d.x_train, d.y_train, **settings | extra)

    def private_generators(self, *salt: int, on_cpu: bool = False) -> tuple[torch.Generator, torch.Generator]:
        """(the Poisson sampler's generator, the noise's, on the node's device) for record-level dp:
        from the OS's entropy, so nobody (the server that knows the run's seed included) knows which
        records a step took or what noise it drew; seeded by dp-noise-seed (and the round, node and
        `salt`) only when that is set, for measurements that promise nothing. `on_cpu`: both on the CPU."""
        from florist.common import privacy

        rng = privacy.noise_generator(self.cfg.dp_noise_seed, self.server_round, privacy.node_word(self.key), *salt)
        seeds = rng.integers(0, 2**62, size=2)
        noise = torch.Generator(device=self.device) if self.device.type == "cuda" and not on_cpu else torch.Generator()
        return torch.Generator().manual_seed(int(seeds[0])), noise.manual_seed(int(seeds[1]))

    def seed(self, *salt: int) -> tuple[int, ...]:
        """(seed, round, node, *salt): what every random draw of this message is seeded by."""
        return self.cfg.seed, self.server_round, zlib.crc32(self.key.encode()), *salt

    def generator(self, *salt: int):
        """A torch generator seeded by (seed, round, node, *salt)."""
        return training.seeded_generator(*self.seed(*salt))

    def test_reply(self, model: Net, **extra: float) -> RecordDict:
        """The standard evaluate reply: accuracy and loss of `model` on this node's test split,
        which the node keeps as the model it earned in this run (`client/personal.py`)."""
        probs = training.predict_proba(model, self.data.x_test, device=self.device)
        personal.keep(self, model, probs)
        return self.score_reply(probs, **extra)

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
        if d.cluster is not None:  # a shift scenario: the report breaks accuracy down by cluster
            metrics["shift-cluster"] = d.cluster
        if d.skipped_images:  # its results.json row says how many bad image files it left out
            metrics["skipped-images"] = d.skipped_images
        return protocol.content(metrics=metrics | {"accuracy": accuracy, "loss": loss} | extra)


def parse(
    msg: Message, context: Context, exchange: Exchange, strategies: Mapping[str, StrategySpec]
) -> tuple[Node, Request]:
    """The node and request of `msg` (see the module docstring for where settings come from);
    `strategies`: the specs a message's `strategy` may name."""
    node_config = dict(context.node_config)
    config = dict(msg.content.config_records.get(protocol.CONFIG, {}))
    source = f"the server's {msg.metadata.message_type!r} message"
    key = node_key(node_config)
    florist = "strategy" in config  # else one of Flower's strategies sent it
    if florist:  # florist's server: exactly the declared keys
        spec = _spec(strategies, str(config["strategy"]))
        expected = {
            "server-round",
            "run-id",
            *RunConfig.keys(True),
            *spec.settings.keys(True),
            *exchange.settings.keys(),
        }
        unknown, missing = sorted(set(config) - expected), sorted(expected - set(config))
        if unknown or missing:
            raise protocol.ProtocolError(
                f"{source} does not match strategy {spec.name!r}: unknown keys {unknown}, missing keys {missing}"
            )
        shared = {*RunConfig.keys(True), *spec.settings.keys(True)}
        cfg = _run_config({k: v for k, v in config.items() if k in shared}, node_config, key)
        request = exchange.settings.from_mapping(config, strict=True)
        server_round, run_id = (coerce(key, config[key], int) for key in ("server-round", "run-id"))
    else:  # one of Flower's strategies: the run config, and what it shares with the message
        run = dict(context.run_config) | {k: v for k, v in config.items() if k in RunConfig.keys()}
        cfg = _run_config({k: v for k, v in run.items() if k != "server-round"}, node_config, key)
        request, server_round, run_id = exchange.settings(), int(config.get("server-round", 0)), msg.metadata.run_id
    cfg = cfg.for_node(node_config)
    key, seen, client = _identity(node_config, cfg)
    state = NodeState(node_config.get("state-dir"), key, cfg.strategy, context.state)
    flower = {"flower_driven": not florist, "flower_run_id": msg.metadata.run_id}
    node = Node(key, seen, run_id, server_round, cfg, client, state, node_config, **flower)
    return node, Request(request, msg.content)


def _spec(strategies: Mapping[str, StrategySpec], name: str) -> StrategySpec:
    if name not in strategies:
        raise protocol.ProtocolError(f"unknown strategy {name!r}; this node knows {', '.join(strategies)}")
    return strategies[name]


def _run_config(values: dict, node_config: dict, key: str) -> RunConfig:
    """The server's settings `values` as this node takes them: refused in one line when one is
    unknown or of the wrong type, even one the node overrides (the message is malformed); with its
    own folders and hardware (`guard.own_paths`, `guard.own_hardware`), and refused, before
    anything is allocated, beyond its class, batch-size or pixel cap."""
    who, limits = f"node {key}", guard.Limits.of(node_config)
    try:  # the server's config as it sent it, before the node's own values replace any of it
        RunConfig.check_types(values)
    except ValueError as err:
        raise ValueError(f"{who}: the server's {err}") from None
    values = guard.own_privacy(guard.own_paths(values, node_config, who), node_config, who)
    cfg = RunConfig.from_mapping(guard.own_hardware(values, node_config, who))
    limits.check_classes(cfg.num_classes, who)
    limits.check_batch_size(cfg.batch_size, who)
    if "image-size" not in node_config:  # the node's own, applied later, is its own to choose
        limits.check_image_size(folders.parse_image_size(cfg.image_size), who)
    return cfg


def node_key(node_config: dict) -> str:
    """This node's key: `node-key` from its config, else `partition-N`, else (a node with a
    `data-dir`) a hash of its folder's path."""
    if "node-key" in node_config:
        return str(node_config["node-key"])
    if "data-dir" in node_config:  # opaque: the server and every log would otherwise learn where the data is
        folder = str(Path(str(node_config["data-dir"])).expanduser().absolute())
        return "node-" + hashlib.sha256(folder.encode()).hexdigest()[:12]
    return f"partition-{node_config.get('partition-id')}"


def node_data(node_config: dict, cfg: RunConfig) -> data_lib.ClientData:
    """The data a node with `node_config` holds in a run of `cfg` (its splits exactly as its
    handlers see them): what `florist predict --split` scores a kept model on."""
    return _identity(node_config, cfg.for_node(node_config), say=False)[2]


def _identity(node_config: dict, cfg: RunConfig, say: bool = True) -> tuple[str, bool, data_lib.ClientData]:
    """(node key, seen, data) from the node config; `say`: log the data's line (a node's log, not
    `florist predict`'s output)."""
    if "data-dir" in node_config:
        source = str(Path(str(node_config["data-dir"])).expanduser())
        client = _cached_folder(source, cfg, node_config)
        seen = not bool(node_config.get("unseen", False))
    else:
        pid, num = int(node_config["partition-id"]), int(node_config["num-partitions"])
        source = f"{cfg.dataset!r}, partition {pid} of {num}"
        client = scenarios.client_data(pid, num, cfg)
        seen = pid not in data_lib.unseen_partitions(num, cfg.unseen_fraction, cfg.seed)
    names = classnames.named(cfg.dataset, cfg.num_classes, node_config.get("data-dir")) if say else None
    if say and (described := client.describe(source, names)) not in _DESCRIBED:  # once per process and data
        _DESCRIBED.add(described)
        log.info("%s", described)
    return node_key(node_config), seen, client


def _cached_folder(data_dir: str, cfg: RunConfig, node_config: dict) -> data_lib.ClientData:
    """The node's folder, decoded once per machine (`common/datacache.py`) and per image options
    (keyed by its file listing and those, so a changed file or option is decoded again), then
    split in memory as the run says: a server's seeds and fractions add no cache entries."""
    root = Path(data_dir).expanduser()
    images = folders.ImageOptions.of(cfg)
    key = {"data-dir": str(root.absolute()), "files": datacache.folder_fingerprint(root), "layout": "whole"}
    limit = guard.Limits.of(node_config).max_cache_mb * 1e6
    whole = datacache.cached(key | images.key(), lambda: folders.decode_folder(data_dir, images), limit)
    return folders.split_folder(data_dir, whole, cfg.num_classes, cfg.seed, cfg.val_fraction, cfg.test_fraction)


_DESCRIBED: set[str] = set()  # the data lines this process has logged
