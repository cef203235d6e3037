"""FedAvg's server half: the sample-weighted mean of the trained models (FedAvg+ differs only
on the client, which fine-tunes before testing), or the robust rule the run config names
(`aggregation`, `clip-norm`, `max-node-examples`: florist/server/aggregation.py), or, under
`dp = "central"`, DP-FedAvg's clipped and noised mean (florist/common/privacy.py); under
`secure-aggregation`, the weighted mean of updates it never sees one of (florist/server/secure.py)."""

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
from florist.server.aggregation import Aggregator
from florist.server.secure import Outcome, secure_round
from florist.server.strategy import TESTED, TRAINED, NodeInfo, Reply, ServerStrategy, mean_loss, metrics_of
from florist.strategies.fedavg.spec import EVALUATE, SECAGG, TRAIN

log = logging.getLogger("flwr").getChild(__name__)


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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model = self.new_model()
        self.aggregator = Aggregator.of(self.cfg)
        self.extras: dict[str, Any] = {}
        self.privacy = plan(self.cfg, self.sample_size(self.num_seen) / max(1, self.num_seen))
        self.private_rounds = 0  # rounds aggregated under `dp`: what the accountant composes
        self.cheaters: set[str] = set()  # keys of nodes secure aggregation caught revealing wrong shares
        self.secure = self.cfg.secure_aggregation != "none"
        if self.secure:  # a setup no round of this run can have is refused before the run, not at round 1
            secagg.SecAggSetup.for_nodes(
                self.sample_size(self.num_seen),
                self.cfg.secagg_threshold or None,
                clip=self.cfg.secagg_clip,
                bits=self.cfg.secagg_bits,
            )
        if self.secure and type(self).train_round is not FedAvg.train_round and "secured" not in vars(type(self)):
            raise ValueError(
                f"secure-aggregation: strategy {self.cfg.strategy!r} trains in its own train_round, which sends "
                "models in the clear; it must train through FedAvg's (override before_training instead) or "
                "name what it secures itself (`secured`: FedAttn's)"
            )

    def train_round(self, server_round: int, nodes: list[NodeInfo]) -> float | None:
        self.before_training(server_round)
        if self.secure:
            return self.train_securely(server_round, nodes)[0]
        request = self.request(self.training, server_round, protocol.to_record(self.model))
        replies = self.broadcast(self.training, nodes, server_round, request, TRAINED, self.model.state_dict())
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
        if outcome.cheaters:
            self.cheaters |= {n.key for n in outcome.cheaters}
            log.warning("secure aggregation: left out of later rounds: %s", ", ".join(sorted(self.cheaters)))
        if self.privacy.active:  # no dp_zeroed, dp_clipped, loss nor clipped count: un-noised sums, not sent
            self.private_rounds += 1
            self.extras |= self.privacy.row(self.private_rounds)
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
            self.private_rounds += 1
            zeroed = sum(r.metrics.get("dp-zeroed", 0) == 1 for _, r in done)  # a node's claim counts once
            self.extras = self.aggregate_private([r.arrays for _, r in done]) | zeroed_row(zeroed)
        elif done:
            outcome = self.aggregator([r.arrays for _, r in done], weights, self.model.state_dict())
            self.model.load_state_dict(outcome.state)
            if not self.aggregator.plain:
                self.extras = outcome.row([n.key for n, _ in done])
        return mean_loss(r.metrics | {"num-examples": w} for (_, r), w in zip(done, weights))

    def aggregate_private(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """The global model from the `states` under `dp`, and the round's privacy figures:
        `central`, DP-FedAvg's noised mean over the m nodes a round samples (the noise drawn
        by (dp-noise-seed, round) when that seed is set); `local`, the plain mean of updates
        the nodes noised themselves, each weighing 1 as in `central`."""
        if self.privacy.mode == "local":
            if states:
                self.model.load_state_dict(self.aggregator(states, [1.0] * len(states), self.model.state_dict()).state)
            return self.privacy.row(self.private_rounds)
        rng = privacy.noise_generator(self.cfg.dp_noise_seed, self.private_rounds)
        sampled = self.sample_size(self.num_seen)
        state, clipped = privacy.central_mean(states, self.model.state_dict(), sampled, self.privacy, rng)
        self.model.load_state_dict(state)
        return self.privacy.row(self.private_rounds, clipped)

    def stop_before(self, server_round: int) -> str:
        """Under `dp` with σ given and `dp-epsilon` as a cap: stop before the round that would
        spend more."""
        return self.privacy.stop_before(self.private_rounds + 1)

    def state(self) -> dict[str, Any]:
        cheaters = {"secagg_cheaters": sorted(self.cheaters)} if self.cheaters else {}
        return super().state() | ({"private_rounds": self.private_rounds} if self.privacy.active else {}) | cheaters

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.private_rounds = int(state.get("private_rounds", 0))
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


def zeroed_row(count: int) -> dict[str, int]:
    """`dp_zeroed`: how many nodes' training diverged on the noised global model, so that they sent
    no change (florist/strategies/fedavg/client.py's `zeroed`), said on the console when any did."""
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
    if cfg.dp == "none" and math.isfinite(cfg.dp_epsilon):
        raise ValueError(
            f'dp-epsilon = {cfg.dp_epsilon:g} but dp = "none": {cfg.strategy} would noise nothing; '
            'set dp = "central" or "local" (docs/privacy.md)'
        )
    return privacy.Plan.of(cfg, q)
