"""FedAvg's server half: the sample-weighted mean of the trained models (FedAvg+ differs only
on the client, which fine-tunes before testing), or the robust rule the run config names
(`aggregation`, `clip-norm`, `max-node-examples`: florist/server/aggregation.py), or, under
`dp = "central"`, DP-FedAvg's clipped and noised mean (florist/common/privacy.py); under
`secure-aggregation`, the weighted mean of updates it never sees one of (florist/server/secure.py);
then, with `server-momentum` or `server-lr`, FedAvgM's server step on it (florist/server/momentum.py)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from florist.common import packing, privacy, protocol, secagg
from florist.common import secagg_records as records
from florist.common.models import Net
from florist.common.spec import Exchange
from florist.config import RunConfig
from florist.server.accounting import Ledger
from florist.server.aggregation import Aggregator
from florist.server.momentum import ServerMomentum
from florist.server.secure import RANGE_STDS, Outcome, secure_round
from florist.server.strategy import TESTED, NodeInfo, Reply, ServerStrategy, mean_loss, metrics_of
from florist.strategies.fedavg.spec import EVALUATE, SECAGG, TRAIN

log = logging.getLogger("flwr").getChild(__name__)
# `distributed`: the chance a value's noise share passes the quantization range (RANGE_STDS of its std)
SHARE_CLIPPED = math.erfc(RANGE_STDS / math.sqrt(2))


def exchange_bytes(model: Net, config: Mapping[str, Any]) -> tuple[int, int]:
    """(up, down) bytes of one client's FedAvg training exchange with `model`, measured on the
    messages FedAvg builds: the yardstick for strategies that send less."""
    request = protocol.content(protocol.to_record(model), config)
    reply = protocol.content(protocol.to_record(model), metrics={"num-examples": 1, "train-loss": 0.0})
    return protocol.nbytes(packing.pack(reply)), protocol.nbytes(packing.pack(request))


class FedAvg(ServerStrategy):
    """Sample-weighted FedAvg on Flower's standard `train` / `evaluate` messages."""

    training: Exchange = TRAIN  # kNN-Per trains with its own exchange (its handler swaps the data in phase 2)
    evaluation: Exchange = EVALUATE  # kNN-Per personalizes at evaluation with its own exchange
    checkpointed = ("model",)
    # Their every message is FedAvg's training exchange (kNN-Per: its global model; its datastore
    # never leaves the node) or an evaluation, which sends the model down only.
    protected = secured = ("fedavg", "fedavg-ft", "knnper")
    # Under record-level dp (their specs' `record_covered`) the model a node sends is DP-SGD's output; FedAvg+'s
    # fine-tuning and kNN-Per's datastore stay on the node.

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model = self.new_model()
        self.aggregator = Aggregator.of(self.cfg)
        self.server_step = ServerMomentum(self.cfg.server_momentum, self.cfg.server_lr)
        self.extras: dict[str, Any] = {}
        # the rounds aggregated under `dp`, each's (q, σ): what the accountant composes
        self.ledger = Ledger(plan(self.cfg, self.sample_size(self.num_seen) / max(1, self.num_seen)), self.num_seen)
        self.cheaters: set[str] = set()  # keys of nodes secure aggregation caught revealing wrong shares
        self.secure = self.cfg.secure_aggregation != "none"
        if self.secure:  # a setup no round of this run's size can have is refused before the run, not at round 1
            self.secure_setup(self.sample_size(self.num_seen))
        if self.secure and type(self).train_round is not FedAvg.train_round and "secured" not in vars(type(self)):
            raise ValueError(
                f"secure-aggregation: strategy {self.cfg.strategy!r} trains in its own train_round, which sends "
                "models in the clear; it must train through FedAvg's (override before_training instead) or "
                "name what it secures itself (`secured`: FedAttn's)"
            )

    def steps_on_server(self) -> bool:
        """FedAvg's own train_round ends with the server step; FedAttn's takes none."""
        return type(self).train_round is FedAvg.train_round

    @property
    def privacy(self) -> privacy.Plan:
        return self.ledger.plan

    @privacy.setter
    def privacy(self, plan: privacy.Plan) -> None:
        self.ledger.plan = plan

    @property
    def private_rounds(self) -> int:
        return len(self.ledger)

    def secure_setup(self, count: int) -> secagg.SecAggSetup:
        """The secure-aggregation setup of a round of `count` nodes; a ValueError when none can be."""
        cfg = self.cfg
        return secagg.SecAggSetup.for_nodes(
            count, cfg.secagg_threshold or None, clip=cfg.secagg_clip, bits=cfg.secagg_bits
        )

    def train_round(self, server_round: int, nodes: list[NodeInfo]) -> float | None:
        """The round's aggregate, then the server's step along it (`server-momentum`, `server-lr`)."""
        sent = {key: t.clone() for key, t in self.model.state_dict().items()} if self.server_step.active else None
        loss = self.train_aggregate(server_round, nodes)
        if sent is not None:
            self.model.load_state_dict(self.server_step.step(sent, self.model.state_dict()))
        return loss

    def train_aggregate(self, server_round: int, nodes: list[NodeInfo]) -> float | None:
        """One exchange with the sampled `nodes`; their aggregate loaded into the global model."""
        self.before_training(server_round)
        if self.secure and self.samples_privately(self.num_seen) and not self.maskable(len(nodes)):
            # Too few drawn to mask (a Poisson sample varies): the round releases the noise alone, as
            # if its nodes all failed, which the fixed denominator bounds; none is seen unmasked.
            log.info(
                "round %d: %d node(s) drawn, too few to mask; the round adds its noise alone", server_round, len(nodes)
            )
            return self.aggregate([])
        if self.secure:
            return self.train_securely(server_round, nodes)[0]
        request = self.request(self.training, server_round, protocol.to_record(self.model))
        # under local or record-level dp a node sends no train loss (nothing un-noised of its data leaves it)
        expected = self.trained_metrics
        replies = self.broadcast(self.training, nodes, server_round, request, expected, self.model.state_dict())
        done = [(n, replies[n.node_id]) for n in nodes if n.node_id in replies]  # fixed order: same seed, same sums
        return self.aggregate(done)

    def before_training(self, server_round: int) -> None:
        """What a strategy does to its models before a round trains them (kNN-Per's phases)."""

    def train_securely(
        self, server_round: int, nodes: list[NodeInfo], sent=None, side=None
    ) -> tuple[float | None, Outcome]:
        """The round under `secure-aggregation`: the nodes' weighted mean update, learnt through
        SecAgg+'s four exchanges, added to the model sent (the mean train loss comes the same way,
        without dp only: None under it).
        Under `dp`, every node weighs 1; `central` noises the unmasked sum (the nodes clipped their
        updates to dp-clip) and divides by the nodes sampled, as DP-FedAvg does in the clear;
        `distributed` divides the same way a sum the nodes noised, each with its share. `sent`
        and `side`: each node's own model, and what it sends in the clear (`secure_round`). A node
        caught cheating (`Outcome.cheaters`) takes part in no later round, of this run or a resumed one."""
        nodes = [n for n in nodes if n.key not in self.cheaters]
        start = self.model.state_dict()
        shapes = {key: tuple(t.shape) for key, t in start.items() if t.is_floating_point()}
        tail = records.tail(self.cfg.dp)
        size = sum(math.prod(shape) for shape in shapes.values()) + len(tail)
        weight_cap = 1.0 if self.privacy.active else self.weight_cap(nodes)
        sigma = self.privacy.sigma if self.privacy.mode == "distributed" else 0.0
        sent = sent or protocol.to_record(self.model)
        outcome = secure_round(
            self, SECAGG, nodes, server_round, sent, size, weight_cap, sigma, side, self.privacy.active
        )
        delta = records.unflatten(outcome.mean, shapes)
        self.extras = outcome.row()
        if self.samples_privately(self.num_seen):  # results keep how many dropped, not who was drawn
            self.extras["secagg_dropped"] = len(outcome.dropped)
        if outcome.cheaters:
            self.cheaters |= {n.key for n in outcome.cheaters}
            log.warning("secure aggregation: left out of later rounds: %s", ", ".join(sorted(self.cheaters)))
        if self.privacy.active:  # no dp_zeroed, dp_clipped, loss nor clipped count: un-noised sums, not sent
            self.ledger.record(size * len(outcome.survivors) * SHARE_CLIPPED if sigma > 0 else 0.0)
            self.extras |= self.ledger.row()
            del self.extras["secagg_clipped"]
        if self.privacy.mode in ("central", "distributed"):
            count = len(outcome.survivors)
            total = {key: d * count for key, d in delta.items()}
            if self.privacy.mode == "central":
                rng = privacy.noise_generator(self.cfg.dp_noise_seed, self.private_rounds)
                total = privacy.add_noise(total, self.privacy.sigma * self.privacy.clip, rng)
            delta = {key: d / self.sample_size(self.num_seen) for key, d in total.items()}
        self.model.load_state_dict(privacy.applied(start, delta))
        loss = float(outcome.mean[-1]) * records.LOSS_RANGE / outcome.value_range if tail else None
        return loss, outcome

    def weight_cap(self, nodes: list[NodeInfo]) -> float:
        """W, the most a node weighs in a secure round: `secagg-max-weight`, else `max-node-examples`,
        else the largest train split the nodes reported at discovery (each caps its own weight at it)."""
        return self.cfg.secagg_max_weight or self.cfg.max_node_examples or max(n.num_train for n in nodes)

    def aggregate(self, done: list[tuple[NodeInfo, Reply]]) -> float | None:
        """Load the aggregate of the `done` nodes' models into the global model (each node's
        weight capped by what it reported at discovery); return their weighted mean loss."""
        weights = [self.aggregator.weight(r.metrics["num-examples"], n.num_train) for n, r in done]
        self.extras = {}
        if self.privacy.active:
            self.ledger.record()
            zeroed = sum(r.metrics.get("dp-zeroed", 0) == 1 for _, r in done)  # a node's claim counts once
            self.extras = self.aggregate_private([r.arrays for _, r in done]) | zeroed_row(zeroed, self.privacy.mode)
        elif done:
            outcome = self.aggregator([r.arrays for _, r in done], weights, self.model.state_dict())
            self.model.load_state_dict(outcome.state)
            if not self.aggregator.plain:
                self.extras = outcome.row([n.key for n, _ in done])
        if self.privacy.mode == "local":  # its nodes sent no train loss
            return None
        return mean_loss(r.metrics | {"num-examples": w} for (_, r), w in zip(done, weights))

    def aggregate_private(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """The global model from the `states` under `dp`, and the round's privacy figures:
        `central`, DP-FedAvg's noised mean over the m nodes a round samples (the noise drawn
        by (dp-noise-seed, round) when that seed is set); `local`, the plain mean of updates
        the nodes noised themselves, each weighing 1 as in `central`."""
        if self.privacy.mode == "local":
            if states:
                self.model.load_state_dict(self.aggregator(states, [1.0] * len(states), self.model.state_dict()).state)
            return self.ledger.row()
        rng = privacy.noise_generator(self.cfg.dp_noise_seed, self.private_rounds)
        sampled = self.sample_size(self.num_seen)
        state, clipped = privacy.central_mean(states, self.model.state_dict(), sampled, self.privacy, rng)
        self.model.load_state_dict(state)
        return self.ledger.row(clipped)

    def stop_before(self, server_round: int) -> str:
        """Under `dp` with σ given and `dp-epsilon` as a cap: stop before the round that would
        spend more."""
        return self.ledger.stop_before()

    def maskable(self, count: int) -> bool:
        """Whether a round of `count` nodes can be masked (at least 2, the threshold's worth)."""
        try:
            self.secure_setup(count)
        except ValueError:
            return False
        return True

    def state(self) -> dict[str, Any]:
        cheaters = {"secagg_cheaters": sorted(self.cheaters)} if self.cheaters else {}
        ledger = self.ledger.state() if self.privacy.active else {}
        return super().state() | ledger | cheaters | self.server_step.state()

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.server_step.load(state)
        if self.privacy.active:
            self.ledger.load(state)
        self.cheaters = set(state.get("secagg_cheaters", []))

    def round_extras(self) -> dict[str, Any]:
        """Under a robust rule: the rule that ran, why it is not the one the run names (or what
        it did not count; "" when nothing), and the nodes it left out or clipped. Under `dp`:
        ε spent so far, σ, and (central) how many updates were clipped."""
        return self.extras

    def evaluate(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        """Send the global model with `evaluation`; clients personalize it their way."""
        request = self.request(self.evaluation, server_round, protocol.to_record(self.model))
        return metrics_of(self.broadcast(self.evaluation, nodes, server_round, request, TESTED))


def zeroed_row(count: int, mode: str) -> dict[str, int]:
    """`dp_zeroed`: how many nodes' training diverged on the noised global model, so that they sent
    no change (florist/strategies/fedavg/client.py's `zeroed`), said on the console when any did;
    none under `local`, whose nodes do not say (a flag of their data, un-noised)."""
    if mode == "local":
        return {}
    if count:
        log.warning(
            "dp: %s node(s) diverged on the noised global model and sent no change (dp_zeroed); "
            "a lower lr or more nodes a round (less noise per node) would help",
            count,
        )
    return {"dp_zeroed": count}


def plan(cfg: RunConfig, q: float) -> privacy.Plan:
    """The run's `dp` as a `privacy.Plan`, `q` the share of the seen nodes a round samples. A
    finite `dp-epsilon` without `dp` is refused: FedAvg would noise nothing (only OD-PFL reads
    dp-epsilon on its own)."""
    if cfg.dp == "none" and math.isfinite(cfg.dp_epsilon):  # (under dp = "record" it is DP-SGD's budget)
        raise ValueError(
            f'dp-epsilon = {cfg.dp_epsilon:g} but dp = "none": {cfg.strategy} would noise nothing; '
            'set dp = "central", "local" or "record" (docs/privacy.md)'
        )
    return privacy.Plan.of(cfg, q)
