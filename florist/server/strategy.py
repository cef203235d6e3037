"""The small base every strategy's server half stands on: `ServerStrategy` holds the run's
settings and the round skeleton; a round is any number of exchanges with the nodes
(`server/exchange.py`), so multi-message strategies fit the same mould as FedAvg."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict

from florist.common import devices, privacy, protocol
from florist.common.metrics import weighted_mean
from florist.common.models import Net, seeded_model
from florist.common.spec import Exchange
from florist.config import RunConfig
from florist.server.exchange import Exchanger

# A child of Flower's logger, so messages reach `flwr run --stream` and the SuperLink log.
log = logging.getLogger("flwr").getChild(__name__)


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """What a node told the server about itself at the start of the run."""

    node_id: int
    key: str
    seen: bool
    num_train: int
    num_test: int
    input_shape: tuple[int, ...]
    # what it said of its data (`protocol.data_of`: source, class names, bad files), for report.md
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        return f"node {self.node_id} ({self.key})"


class Reply(NamedTuple):
    """A node's checked reply: its metrics, its arrays (the model) and its `side` arrays
    (anything else it sends beside the model), each when the exchange expects them."""

    metrics: dict[str, float]
    arrays: dict[str, torch.Tensor]
    side: dict[str, torch.Tensor] = {}


SAMPLING = 0x5A4D  # the word a seeded (dp-noise-seed) Poisson sample is drawn by, apart from the noise's
TRAINED = ("num-examples", "train-loss")  # metrics every training reply carries
TESTED = ("accuracy", "num-examples")  # metrics every evaluation reply carries


class ServerStrategy:
    """A personalization algorithm's server half.

    Subclasses implement `train_round` (any number of exchanges) and `evaluate` (per-node
    metrics with at least `accuracy` and `num-examples`); `serve` gives nodes that never trained
    their personalized model (by default through `evaluate`). `self.settings` is the
    algorithm's own section of the run config.
    """

    def __init__(self, cfg: RunConfig, exchanger: Exchanger, input_shape: tuple[int, ...], num_seen: int):
        """`num_seen`: how many nodes train (some algorithms size their networks by it)."""
        self.cfg, self.exchanger, self.input_shape, self.num_seen = cfg, exchanger, input_shape, num_seen
        self.settings: Any = cfg.settings
        if refusal := cfg.record_refusal():  # the spec's coverage, checked as the config was parsed; again here
            raise ValueError(refusal)
        if cfg.user_dp != "none" and cfg.strategy not in self.protected:
            raise ValueError(
                f'dp = "{cfg.dp}": strategy {cfg.strategy!r} has no differential privacy yet (docs/privacy.md)'
            )
        if cfg.secure_aggregation != "none" and cfg.strategy not in self.secured:
            raise ValueError(
                f"secure-aggregation: strategy {cfg.strategy!r} is not covered, its server needs each node's "
                f"message (covered: fedavg, fedavg-ft, knnper, fedattn; docs/secure-aggregation.md)"
            )
        if (cfg.server_momentum, cfg.server_lr) != (0.0, 1.0) and not self.steps_on_server():
            raise ValueError(
                f"server-momentum, server-lr: strategy {cfg.strategy!r} takes no server step; leave them at 0 "
                "and 1 (covered: fedavg, fedavg-ft, knnper; docs/strategies/baselines.md)"
            )
        # Where the server half's own networks train (`server-device`); what it sends and saves stays on the CPU.
        self.device = devices.resolve(cfg.server_device, "server-device")

    # The strategies (by name) whose every node message this server half's `dp` protects, and
    # those whose shared model it sums under `secure-aggregation`; any other refuses the option
    # before the run (the preflight builds the server half).
    protected: tuple[str, ...] = ()
    secured: tuple[str, ...] = ()
    # Which strategies `dp = "record"` covers, and why not the others, their specs say (`StrategySpec.record_covered`,
    # `record_gap`): the run config refuses the others before torch is imported (`RunConfig.record_refusal`).

    def steps_on_server(self) -> bool:
        """Whether its rounds end with FedAvg's server step (`server-momentum`, `server-lr`)."""
        return False

    @property
    def trained_metrics(self) -> tuple[str, ...]:
        """The metrics every training reply carries: no train loss under local or record-level dp (an
        un-noised value of the node's data), else TRAINED."""
        return ("num-examples",) if self.cfg.user_dp == "local" or self.cfg.record_dp else TRAINED

    @staticmethod
    def report(results: dict[str, Any], folder: Path) -> list[str]:
        """The algorithm's own section of report.md (markdown lines; its figures go in `folder`)."""
        return []

    def new_model(self) -> Net:
        """The run's model, seeded: clients that build it from the same seed get the same weights."""
        return seeded_model(self.cfg.model, self.input_shape, self.cfg.num_classes, self.cfg.seed)

    def sample_size(self, available: int) -> int:
        """How many nodes a round trains: `fraction-train` of them, at least `min-train-nodes`."""
        return min(available, max(self.cfg.min_train_nodes, math.ceil(self.cfg.fraction_train * available)))

    def sample(self, nodes: list[NodeInfo], server_round: int) -> list[NodeInfo]:
        """The nodes a round trains. `sample_size` of them drawn uniformly without replacement,
        seeded by the round, so a run repeats; but under central dp with a rate q < 1, each node
        independently with probability q (Poisson sampling, what the accountant's amplification
        assumes), from the OS's entropy: a sample anyone could replay from the run's seed would
        be public and amplify nothing (docs/privacy.md#accounting)."""
        if self.samples_privately(len(nodes)):
            rate = self.sample_size(len(nodes)) / len(nodes)
            rng = privacy.noise_generator(self.cfg.dp_noise_seed, server_round, SAMPLING)  # seeded: measurements only
            return [node for node, drawn in zip(nodes, rng.random(len(nodes)) < rate) if drawn]
        rng = np.random.default_rng([self.cfg.seed, server_round])
        return [nodes[i] for i in sorted(rng.choice(len(nodes), self.sample_size(len(nodes)), replace=False))]

    def samples_privately(self, available: int) -> bool:
        """Whether a round's sample is Poisson, from the OS (central dp, not every node each round);
        results then keep how many trained, never who."""
        return self.cfg.user_dp == "central" and self.sample_size(available) < available

    def request(
        self,
        exchange: Exchange,
        server_round: int,
        arrays: ArrayRecord | None = None,
        side: ArrayRecord | None = None,
        **values: Any,
    ) -> RecordDict:
        """A request of `exchange`: the records, the settings that travel, and the exchange's
        own settings `values` (checked against its declared `request` dataclass)."""
        config = protocol.message_config(self.cfg, exchange, server_round, self.exchanger.run_id, **values)
        return protocol.content(arrays, config, side=side)

    def ask(
        self,
        exchange: Exchange,
        requests: Mapping[int, RecordDict],
        server_round: int,
        required: tuple[str, ...],
        reference: Mapping[str, torch.Tensor] | None = None,
        side: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[int, Reply]:
        """Send `requests[node]` to each node; return, by node, the replies whose `metrics`
        carry the `required` ones and, when a `reference` (or `side`) is given, whose `arrays`
        (or `side` arrays) match it: keys, shapes, finite values. Any other reply is recorded
        as a failure."""
        good: dict[int, Reply] = {}
        message_type = exchange.message_type
        expect = {k: v for k, v in ((protocol.ARRAYS, reference), (protocol.SIDE, side)) if v is not None}
        for node, content in self.exchanger.round_trip(requests, message_type, server_round, expect).items():
            name = self.exchanger.name(node)
            try:
                metrics = protocol.metrics_of(content, required, name)
                arrays = {} if reference is None else protocol.arrays_of(content, reference, name)
                extra = {} if side is None else protocol.arrays_of(content, side, name, protocol.SIDE)
            except protocol.ProtocolError as err:
                self.exchanger.fail(node, message_type, server_round, str(err))
                continue
            good[node] = Reply(metrics, arrays, extra)
        return good

    def broadcast(
        self,
        exchange: Exchange,
        nodes: list[NodeInfo],
        server_round: int,
        content: RecordDict,
        required: tuple[str, ...],
        reference: Mapping[str, torch.Tensor] | None = None,
        side: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[int, Reply]:
        """`ask` with the same `content` for every node."""
        return self.ask(exchange, {n.node_id: content for n in nodes}, server_round, required, reference, side)

    def train_round(self, server_round: int, nodes: list[NodeInfo]) -> float | None:
        """Run one training round with `nodes`; return the mean training loss (None if none)."""
        raise NotImplementedError

    def evaluate(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        """Per-node test metrics of each node's (personalized) model."""
        raise NotImplementedError

    def serve(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        """The serve phase: personalize and score nodes that took no part in training (held-out
        clients, or nodes that joined afterwards). No training happens on any side beyond what
        the strategy's personalization itself does; by default that is its evaluation."""
        return self.evaluate(server_round, nodes)

    # Attributes with `state_dict()` / `load_state_dict()` (networks, optimizers) that make up
    # the server's state; `state` and `load_state` add anything else a subclass keeps.
    checkpointed: tuple[str, ...] = ()

    def state(self) -> dict[str, Any]:
        """Everything the server half needs to go on from here (checkpointed after every round):
        tensors, dicts, lists and numbers only, so that a checkpoint loads without pickle."""
        return {name: getattr(self, name).state_dict() for name in self.checkpointed}

    def load_state(self, state: dict[str, Any]) -> None:
        """Go on from a `state()` saved by an earlier process of the same run."""
        for name in self.checkpointed:
            getattr(self, name).load_state_dict(state[name])

    def stop_before(self, server_round: int) -> str:
        """Why the run must train no more from round `server_round` on ("" to go on): e.g. a
        privacy budget that round would exceed. The run then evaluates and ends as usual."""
        return ""

    def round_extras(self) -> dict[str, Any]:
        """Figures of the last training round to keep in its results row beside the standard
        ones (e.g. what FedAvg would have sent instead)."""
        return {}


def metrics_of(replies: Mapping[int, Reply]) -> dict[int, dict[str, float]]:
    """The metrics of each node's reply (what `evaluate` and `serve` return)."""
    return {node: reply.metrics for node, reply in replies.items()}


def mean_loss(metrics: Iterable[Mapping[str, float]]) -> float | None:
    """Example-weighted mean of `train-loss` over replies (None when there are none, or they carry
    none: under local or record-level dp no node sends it)."""
    rows = list(metrics)
    if not rows or any("train-loss" not in m for m in rows):
        return None
    return weighted_mean([m["train-loss"] for m in rows], [m["num-examples"] for m in rows])
