"""Differential privacy of the model updates (run-config `dp`, docs/privacy.md): what a run spends
by the RDP accountant, the noise multiplier that spends a budget exactly, and the Gaussian
mechanism on one update. Both halves use it (the server for `central`, a node for `local`) and
the command line checks a run with it, so it imports no torch: states are dicts of tensors,
touched only through their own methods, and the arithmetic is numpy's, in float64.

DP-FedAvg (McMahan et al., 2018, "Learning differentially private recurrent language
models"): each round samples nodes, clips each node's update Δ_k = θ_k − θ_g to L2 norm C,
and adds N(0, σ²C²) per coordinate to Σ_k Δ_k, so one node's data moves the sum by at most C
(user-level DP). The accountant takes a round as the Poisson-subsampled Gaussian mechanism with
rate q and noise multiplier σ, composed round by round (each round's (q, σ) kept: a resume with
other nodes adds) by Google's `dp-accounting`, RDP (Mironov, 2017; Mironov et al., 2019) or PLD,
whichever bounds ε tighter. Under central dp with q < 1 the server draws each node with probability
q from the OS's entropy (`ServerStrategy.sample`): the Poisson sampling the accountant assumes, and
a sample nobody can replay from the run's seed.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

USER_MODES = ("none", "central", "local", "distributed")  # user-level: a node's whole update
# record-level: DP-SGD on every node (each of its records), alone or with a user-level mechanism on top
MODES = (*USER_MODES, "record", *(f"record+{mode}" for mode in USER_MODES[1:]))
RECORD_RELATION = "add/remove one record"  # what record-level ε is about: one record of a node's train split
# RDP orders: integer orders are exact for the subsampled Gaussian; the fractional ones below 2
# do not converge at q = 0.5 (`dp-accounting` warns and drops them) and cost seconds. These give
# σ within 0.05 % of the library's defaults at ε = 3, δ = 1e-5, q = 0.5, 30 rounds, in 0.5 s.
ORDERS = (*(2 + i / 4 for i in range(32)), *range(10, 65), 80, 96, 128, 160, 192, 256)
# running variances (BatchNorm's) that noise pushed below zero are set to zero: post-processing
VARIANCE_SUFFIX = "running_var"

State = Mapping[str, Any]  # a model's state dict: torch tensors, used through their methods only


# Accountants: Rényi DP (Mironov, 2017) and the privacy loss distribution (Koskela et al., 2020;
# Doroshenko et al., 2022), both in `dp-accounting`. Each bounds ε from above (PLD pessimistically
# discretized), so the smaller of the two is a valid bound; PLD is the tighter for Gaussian rounds
# (7-8 % less σ at ε = 3 over 30 rounds), RDP the cheaper and the one Opacus checks.
ACCOUNTANTS = ("rdp", "pld")
PLD_INTERVAL = 1e-3  # the loss grid: ε within 1e-5 of 1e-4's at ε = 3, q = 0.5, 30 rounds, 10× faster
# PLD's grid grows with ε: past this ε (by RDP) it takes seconds a round, or more memory than there
# is at a tiny σ, and a tighter bound on so large an ε says little; RDP's stands alone there.
PLD_UPTO = 20.0

Round = tuple[float, float]  # (q, σ) of one noised round, as the ledger keeps it


def _event(sigma: float, q: float, rounds: int):
    import dp_accounting

    gaussian = dp_accounting.GaussianDpEvent(sigma)
    one = gaussian if q >= 1 else dp_accounting.PoissonSampledDpEvent(q, gaussian)
    return dp_accounting.SelfComposedDpEvent(one, rounds)


def _accountant(kind: str = "rdp"):
    from dp_accounting import pld, rdp

    logging.getLogger("absl").setLevel(logging.ERROR)  # its convergence notes are about orders it drops
    if kind == "pld":
        return pld.PLDAccountant(value_discretization_interval=PLD_INTERVAL)
    return rdp.RdpAccountant(list(ORDERS))


@functools.lru_cache(maxsize=4096)
def spent(rounds: tuple[Round, ...], delta: float, accountant: str = "rdp") -> float:
    """ε after the noised `rounds`, each its own (q, σ), composed in order: a run whose rate or
    σ changed (a resume with other nodes) adds each part at its own cost, never recomputes."""
    import dp_accounting

    if not rounds:
        return 0.0
    runs = [(key, len(list(group))) for key, group in itertools.groupby(rounds)]
    ledger = _accountant(accountant)
    ledger.compose(dp_accounting.ComposedDpEvent([_event(sigma, q, count) for (q, sigma), count in runs]))
    return float(ledger.get_epsilon(delta))


def tightest(rounds: tuple[Round, ...], delta: float) -> tuple[float, str]:
    """(ε, the accountant that bounds it): the smaller of the accountants' bounds, each valid (PLD
    is the tighter over many rounds, RDP over one or two)."""
    rdp = spent(rounds, delta, "rdp")
    if rdp > PLD_UPTO:
        return rdp, "rdp"
    return min((rdp, "rdp"), (spent(rounds, delta, "pld"), "pld"))


def epsilon(sigma: float, q: float, rounds: int, delta: float, accountant: str = "rdp") -> float:
    """ε spent after `rounds` rounds of the Gaussian mechanism with noise multiplier `sigma`,
    each sampling the nodes at rate `q` (1: every round, every node), at this `delta`."""
    return spent(((q, sigma),) * max(0, rounds), delta, accountant)


@functools.lru_cache(maxsize=256)
def noise_multiplier(target: float, delta: float, q: float, rounds: int, accountant: str = "rdp") -> float:
    """The σ with which `rounds` rounds at rate `q` spend `target` ε at `delta` (the smallest
    such σ to `dp-accounting`'s bisection tolerance, so never more than `target`)."""
    import dp_accounting

    _accountant()  # quiets absl before the search
    return float(
        dp_accounting.calibrate_dp_mechanism(
            lambda: _accountant(accountant), lambda sigma: _event(sigma, q, rounds), target, delta, tol=1e-6 * target
        )
    )


def is_record(mode: str) -> bool:
    """Whether `dp` = `mode` trains every node with DP-SGD (record-level dp)."""
    return mode == "record" or mode.startswith("record+")


def user_mode(mode: str) -> str:
    """The user-level mechanism of `dp` = `mode`: itself, what `record+` puts on top, or none."""
    return "none" if mode == "record" else mode.removeprefix("record+")


# Each mechanism's neighbouring relation, what its ε is about (docs/privacy.md#the-relation-per-mechanism).
RELATIONS = {
    "central": "add/remove",  # one node's whole dataset present or absent: the sum moves by at most C
    "distributed": "zero-out",  # a node's update replaced by zero; its noise share stays in the sum
    "local": "zero-out",  # this node's dataset against no data (update 0); `dp-relation` may ask replace-one
}
LOCAL_RELATIONS = ("zero-out", "replace-one")  # replace-one: any two datasets of one node, sensitivity 2C
UNSEEDED = "no guarantee: dp-noise-seed"  # what a run with seeded noise reports instead of ε


@dataclasses.dataclass(frozen=True)
class Plan:
    """A run's differential privacy: `mode` (none | central | local | distributed), the clip bound C, the
    noise multiplier σ (given, or calibrated to spend `cap` over num-server-rounds), δ, the ε the run may
    spend (inf: no cap), and the rate q at which a round takes a node's data (1 for `local`: each
    node noises its own update, and its guarantee is about its own rounds; 1 for `distributed`: its
    guarantee holds against the server, who picks the sample, so sampling amplifies nothing); the
    accountant σ was calibrated by ("" when given), and the neighbouring relation ε is about."""

    mode: str
    clip: float
    sigma: float
    delta: float
    cap: float
    q: float
    accountant: str = ""
    relation: str = "add/remove"
    seeded: bool = False  # dp-noise-seed > 0: whoever knows the seed subtracts the noise, no ε is reported

    @classmethod
    def of(cls, cfg: Any, q: float = 1.0) -> Plan:
        """The plan of a run config (`florist.config.RunConfig`: `dp`, `dp-clip`, `dp-epsilon`
        (inf: not given), `dp-delta`, `dp-noise-multiplier` (0: not given), num-server-rounds),
        a round sampling the nodes at rate `q`. With σ given, dp-epsilon is a cap the run stops
        at; without, σ spends it exactly over the run's rounds, by the accountant that needs less."""
        cfg = cfg.user_level() if hasattr(cfg, "user_level") else cfg  # under record+…, the mechanism on top
        mode, sigma, rounds = cfg.dp, cfg.dp_noise_multiplier, max(1, cfg.num_server_rounds)
        q = 1.0 if mode in ("local", "distributed") else min(1.0, q)  # they do not trust the one who samples
        accountant = ""
        if mode != "none" and sigma <= 0:
            kinds = ACCOUNTANTS if cfg.dp_epsilon <= PLD_UPTO else ("rdp",)
            sigma, accountant = min((noise_multiplier(cfg.dp_epsilon, cfg.dp_delta, q, rounds, a), a) for a in kinds)
        relation = getattr(cfg, "dp_relation", "zero-out") if mode == "local" else RELATIONS.get(mode, "")
        seeded = getattr(cfg, "dp_noise_seed", 0) > 0
        return cls(mode, cfg.dp_clip, sigma, cfg.dp_delta, cfg.dp_epsilon, q, accountant, relation, seeded)

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @property
    def sensitivity(self) -> float:
        """How far one neighbour moves a node's update: C, or 2C between two datasets of one node."""
        return 2 * self.clip if self.relation == "replace-one" else self.clip

    def rounds(self, done: int | tuple[Round, ...]) -> tuple[Round, ...]:
        """The ledger `done` (each noised round's (q, σ)), or `done` rounds at this plan's."""
        return ((self.q, self.sigma),) * done if isinstance(done, int) else done

    def spent(self, done: int | tuple[Round, ...]) -> float:
        """ε after the rounds `done` (a count at this plan's rate, or the ledger): the run's in
        `central`; in `local`, a node's that took part in all of them (every node's is at most this)."""
        return tightest(self.rounds(done), self.delta)[0]

    def stop_before(self, done: int | tuple[Round, ...]) -> str:
        """Why the next round must not run ("" when it may): it would spend more than the cap.
        `done`: the ledger of the rounds noised so far, or (an int) the number of the round asked
        about, every round before it at this plan's rate."""
        if isinstance(done, int):
            history, upto = self.rounds(max(0, done - 1)), self.rounds(done)
        else:
            history, upto = done, (*done, (self.q, self.sigma))
        after = self.spent(upto)
        if not self.active or not math.isfinite(self.cap) or after <= self.cap:
            return ""
        nxt = len(history) + 1
        return (
            f"dp: round {nxt} would spend ε = {after:.3g} > dp-epsilon {self.cap:g} (δ = {self.delta:g}, "
            f"σ = {self.sigma:.4g}); training stops after round {nxt - 1} with ε = {self.spent(history):.3g} spent"
        )

    def row(self, done: int | tuple[Round, ...], clipped: int | None = None) -> dict[str, Any]:
        """A round's results fields: ε spent after the rounds `done` (none with seeded noise, which
        promises nothing), by which accountant, about which relation, σ, and (central) how many
        updates the clip bound cut."""
        eps, accountant = tightest(self.rounds(done), self.delta)
        out = {
            "dp_epsilon": None if self.seeded else eps,
            "dp_noise_multiplier": self.sigma,
            "dp_accountant": accountant,
            "dp_relation": self.relation,
        } | ({"dp_guarantee": UNSEEDED} if self.seeded else {})
        return out | ({} if clipped is None else {"dp_clipped": clipped})


def share_std(sigma: float, clip: float, threshold: int) -> float:
    """`distributed`: the std of the noise each node adds before masking, σ·C/√(t − 1), so that
    in the masked sum of any t or more nodes (a round never unmasks fewer) the others' shares
    alone hold at least central's N(0, σ²C²) per coordinate, whichever one node's data is added
    or removed: all n surviving, n/(t − 1) times its variance. (t > n/2 ≥ 1, so t − 1 ≥ 1.)"""
    return sigma * clip / math.sqrt(max(1, threshold - 1))


def noise_generator(seed: int, *words: int) -> np.random.Generator:
    """The noise's generator: fresh from the OS's entropy when `seed` is 0 (the guarantee needs
    noise nobody can regenerate), else seeded by (seed, *words) for reproducible measurements."""
    return np.random.default_rng() if seed == 0 else np.random.default_rng([seed, *words])


def node_word(key: str) -> int:
    """A node key as a number for `noise_generator` (as `Node.seed` makes it)."""
    return zlib.crc32(key.encode())


def _array(tensor: Any) -> np.ndarray:
    return tensor.detach().cpu().double().numpy()


def update(trained: State, start: State) -> dict[str, np.ndarray]:
    """Δ = trained − start over the floating tensors (float64); integer buffers (BatchNorm's
    counters) are no part of it."""
    return {key: _array(t) - _array(start[key]) for key, t in trained.items() if t.is_floating_point()}


def norm(delta: Mapping[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.square(d).sum()) for d in delta.values()))


def clip(delta: dict[str, np.ndarray], bound: float) -> tuple[dict[str, np.ndarray], bool]:
    """(Δ·min(1, C/‖Δ‖), whether it was cut): the L2 norm over all of Δ's tensors at most C."""
    size = norm(delta)
    if size <= bound:
        return delta, False
    return {key: d * (bound / size) for key, d in delta.items()}, True


def add_noise(delta: dict[str, np.ndarray], std: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Δ + N(0, std²) on every coordinate, drawn tensor by tensor in key order."""
    return {key: d + rng.normal(0.0, std, d.shape) for key, d in sorted(delta.items())}


def applied(start: State, delta: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """start + Δ, each tensor in its own dtype; tensors without a Δ (integer buffers) as in
    `start`; a running variance noise made negative is set to zero (post-processing)."""
    out = {}
    for key, t in start.items():
        if key not in delta:
            out[key] = t.clone()
            continue
        value = _array(t) + delta[key]
        if key.endswith(VARIANCE_SUFFIX):
            value = np.maximum(value, 0.0)
        out[key] = t.new_tensor(value)
    return out


def local_update(start: State, trained: State, plan: Plan, rng: np.random.Generator) -> dict[str, Any]:
    """What a node sends under `local` DP: start + clip(Δ, C) + N(0, σ²C²) per coordinate
    (Flower's `LocalDpMod`, on florist's states)."""
    delta, _ = clip(update(trained, start), plan.clip)
    return applied(start, add_noise(delta, plan.sigma * plan.sensitivity, rng))


def central_mean(
    states: list[State], start: State, sampled: int, plan: Plan, rng: np.random.Generator
) -> tuple[dict[str, Any], int]:
    """(DP-FedAvg's model, how many updates were clipped): start + (Σ_k clip(Δ_k, C) + N(0, σ²C²)) / m
    over the replies, m the number of nodes sampled: a fixed denominator, so a node that fails
    (or whose data is absent) changes the sum by at most C; a reply weighs 1, whatever its size,
    as a sample-count weight would change that sensitivity."""
    total = {key: np.zeros(t.shape) for key, t in start.items() if t.is_floating_point()}
    clipped = 0
    for state in states:
        delta, cut = clip(update(state, start), plan.clip)
        clipped += cut
        for key, d in delta.items():
            total[key] += d
    noised = add_noise(total, plan.sigma * plan.clip, rng)
    return applied(start, {key: d / sampled for key, d in noised.items()}), clipped
