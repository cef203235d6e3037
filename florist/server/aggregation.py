"""How the server combines the nodes' models, when some nodes may lie (run-config `aggregation`,
`clip-norm`, `max-node-examples`).

Rules, for n replies θ_1..θ_n with weights w_k (`florist.config.parse_aggregation` reads them):
- `mean`: FedAvg's Σ w_k·θ_k / Σ w_k (McMahan et al., 2017), today's result bit for bit.
- `median`: the coordinate-wise median (Yin et al., 2018), the mean of the two middle values
  when n is even (as `numpy.median`); weights play no part.
- `trimmed:β`: the coordinate-wise trimmed mean (Yin et al., 2018): each coordinate's ⌊β·n⌋
  smallest and ⌊β·n⌋ largest values dropped, the rest averaged (as `scipy.stats.trim_mean`).
- `krum:f`: the one θ_i with the smallest score Σ ‖θ_i − θ_j‖² over its n − f − 2 nearest θ_j
  (Blanchard et al., 2017); `multikrum:f`: the mean of the m = n − f best-scored, weighted.
The four robust rules (median, trimmed, krum, multikrum) never silently become something
weaker: a round that gives way says why in one warning line and in `Outcome.note` (the round's
`aggregation_note` in results.json), and `Outcome.rule` names the rule that ran.
- A reply equal to the model sent down (`reference`, bit for bit over the floating tensors: no
  training at all) is left out, and identical replies count once (as one vote, kept or left
  out together). Sending θ_g back is a free stall: it lies amid the honest updates, so Krum
  picked it in 6 of 15 rounds (`noop`, krum:1: 80.9% against 93.8% all honest) and picks two
  copies of it every round (10.6%). Both signals are exact and cost one hash per reply; a node
  that adds noise of its own evades them, and then each rule tolerates what its authors prove:
  the median and the trimmed mean fewer than half (a β share) of the replies lying, Krum f.
- What is left must support the rule: `trimmed:β` with ⌊β·n⌋ = 0 would cut nothing (the plain
  mean, which two colluders reach by having one reply refused: 10.6%), and Krum needs
  n > 2f + 2 (a score over fewer neighbours says nothing): the median runs instead, which
  bounds one node among three or more. Fewer than 3 distinct replies cannot outvote one node:
  the model stays as it was (rule `unchanged`; the zero update without a `reference`), so the
  round cannot be steered, and the run goes on, since a node missing one round must not end it.
- Weights are capped at the median weight of the distinct replies: one node's claim (even at
  discovery: the `stall` attack, θ_g with 10¹² examples, held multikrum:1 at 10.6%) cannot
  outweigh an honest node while fewer than half lie; honest counts below the median keep
  their weight. Only Multi-Krum's mean and the choice of integer buffers use weights.
Before the rule, `clip-norm` C > 0 pulls each θ_k to within C of the global model θ_g (L2 over
all floating tensors): θ_k ← θ_g + (θ_k − θ_g)·min(1, C / ‖θ_k − θ_g‖). A node's weight is
min(the `num-examples` it claims, the `num-train` it reported at discovery, `max-node-examples`
when > 0); an honest node claims its num-train, so the cap changes nothing for it. Integer
buffers (BatchNorm's counters) are taken from the heaviest node the rule kept (by the capped
weights under a robust rule), as FedAvg does.

Why not Flower's own: Flower 1.39 has these rules twice. The Message-API ones
(`flwr.serverapp.strategy`: FedMedian, FedTrimmedAvg, Krum, MultiKrum) take reply `RecordDict`s,
so each model would be serialized into an ArrayRecord first, and MultiKrum's distances use
‖x‖² + ‖y‖² − 2x·y in float32: on the 8×8 CNN (72k weights) with models 1e-4 apart per weight
they came out 3% off (8% on the MLP), more than the spread between honest scores, enough to
reorder them. The older `flwr.server.strategy.aggregate` functions take numpy layer lists and
would be exact fed float64, but that module is not exported (absent from its package's
`__all__`), belongs to the strategy API Flower is replacing, and returns no index of the model
Krum picked (to name the nodes left out, and take the counters from). So the coordinate-
wise rules here sort float64 copies of the stacked tensors with numpy (the value of
`numpy.median` and of `scipy.stats.trim_mean`, which those functions call), and Krum's
distances come from `torch.cdist` on the differences, in float64.
The tests check every rule on hand-made tensors, and against Flower's functions fed float64.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from florist.config import RunConfig, parse_aggregation

log = logging.getLogger("flwr").getChild(__name__)

State = dict[str, torch.Tensor]
MIN_VOTES = 3  # the fewest distinct replies among which one node can be outvoted


def weighted_average(states: Sequence[State], weights: Sequence[float]) -> State:
    """Σ w_k·θ_k / Σ w_k for floating tensors; integer buffers (BatchNorm's counters) are
    taken from the client with the largest weight, since averaging a count means nothing."""
    total = float(sum(weights))
    heaviest = states[max(range(len(weights)), key=weights.__getitem__)]
    return {
        key: (
            sum(s[key].double() * (w / total) for s, w in zip(states, weights)).to(ref.dtype)
            if ref.is_floating_point()
            else heaviest[key].clone()
        )
        for key, ref in states[0].items()
    }


def node_weight(claimed: float, num_train: int, cap: int = 0) -> float:
    """A node's weight: the examples it claims, at most the training examples it reported at
    discovery and at most `cap` (when > 0). A lie about `num-examples` buys nothing more."""
    weight = min(claimed, num_train)
    return min(weight, cap) if cap > 0 else weight


def clip_updates(states: Sequence[State], reference: State | None, max_norm: float) -> tuple[list[State], list[int]]:
    """(states, indices clipped): each θ_k whose floating tensors lie further than `max_norm`
    (L2, over all of them) from `reference` (zero when None) is pulled onto that sphere; the
    others are returned as they are (the same objects, bit for bit)."""
    out, clipped = list(states), []
    for k, state in enumerate(states):
        delta = {key: _delta(t, reference, key) for key, t in state.items() if t.is_floating_point()}
        norm = float(torch.sqrt(sum((d * d).sum() for d in delta.values())))
        if norm > max_norm:
            scale = max_norm / norm
            out[k] = dict(state)
            for key, d in delta.items():
                base = 0.0 if reference is None else reference[key].double()
                out[k][key] = (base + d * scale).to(state[key].dtype)
            clipped.append(k)
    return out, clipped


def _delta(tensor: torch.Tensor, reference: State | None, key: str) -> torch.Tensor:
    return tensor.double() - (0.0 if reference is None else reference[key].double())


def coordinatewise(
    states: Sequence[State], weights: Sequence[float], reduce: Callable[[np.ndarray], np.ndarray]
) -> State:
    """`reduce` over the clients' axis (0) of each floating tensor stacked (n × shape, float64,
    as numpy), cast back; integer buffers from the heaviest client."""
    heaviest = states[max(range(len(weights)), key=weights.__getitem__)]
    return {
        key: (
            torch.as_tensor(np.asarray(reduce(torch.stack([s[key] for s in states]).double().numpy()))).to(ref.dtype)
            if ref.is_floating_point()
            else heaviest[key].clone()
        )
        for key, ref in states[0].items()
    }


def median(stacked: np.ndarray) -> np.ndarray:
    """The coordinate-wise median over axis 0, the mean of the two middle values when n is
    even (`numpy.median`'s value). Sorting the axis is 3-4× faster than `numpy.median`,
    `numpy.partition`, or torch's sort, median and kthvalue (72k weights, 5-50 models, 2 cores)."""
    ordered, n = np.sort(stacked, axis=0), len(stacked)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def trimmed_mean(stacked: np.ndarray, beta: float) -> np.ndarray:
    """The mean over axis 0 without each coordinate's ⌊β·n⌋ smallest and largest values
    (`scipy.stats.trim_mean`'s rule, which Flower's functions copy)."""
    n = len(stacked)
    cut = int(beta * n)
    return np.sort(stacked, axis=0)[cut : n - cut].mean(axis=0)


def pairwise_distances(states: Sequence[State]) -> torch.Tensor:
    """n × n squared L2 distances between the states (all floating tensors) in float64, from
    the differences themselves (`torch.cdist` without the ‖x‖² + ‖y‖² − 2x·y shortcut, which
    cancels when models are close), one tensor at a time: no n × d copy of every model."""
    n = len(states)
    distances = torch.zeros(n, n, dtype=torch.float64)
    for key, ref in states[0].items():
        if ref.is_floating_point():
            x = torch.stack([s[key].reshape(-1) for s in states]).double()
            distances += torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist") ** 2
    return distances


def krum_scores(distances: torch.Tensor, f: int) -> torch.Tensor:
    """Each model's Krum score: the sum of its squared distances to its n − f − 2 nearest
    other models (Blanchard et al., 2017, needs n > 2f + 2)."""
    n = len(distances)
    nearest = n - f - 2
    others = [torch.cat([row[:i], row[i + 1 :]]) for i, row in enumerate(distances)]
    return torch.stack([row.sort().values[:nearest].sum() for row in others])


def krum_select(states: Sequence[State], f: int, m: int) -> list[int]:
    """The indices of the `m` best-scored models, in their given order (ties to the earlier)."""
    scores = krum_scores(pairwise_distances(states), f)
    return sorted(torch.argsort(scores, stable=True)[:m].tolist())


def fingerprint(state: State) -> bytes:
    """A digest of the floating tensors' bytes (by key): equal digests, identical models."""
    digest = hashlib.sha256()
    for key in sorted(state):
        if state[key].is_floating_point():
            digest.update(key.encode())
            digest.update(state[key].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.digest()


def votes(states: Sequence[State], reference: State | None) -> tuple[dict[int, list[int]], list[int]]:
    """({first index of each distinct model: the indices of its copies}, indices of the no-op
    models, equal to `reference`; none when it is None), in the given order."""
    noop = fingerprint(reference) if reference is not None else None
    groups: dict[bytes, list[int]] = {}
    noops = []
    for k, state in enumerate(states):
        digest = fingerprint(state)
        if digest == noop:
            noops.append(k)
        else:
            groups.setdefault(digest, []).append(k)
    return {members[0]: members for members in groups.values()}, noops


def capped(weights: Sequence[float]) -> list[float]:
    """The weights, each at most their median (equal weights when that leaves nothing)."""
    cap = float(np.median(weights))
    out = [min(float(w), cap) for w in weights]
    return out if sum(out) > 0 else [1.0] * len(out)


def gives_way(rule: str, arg: float, n: int) -> tuple[str, str]:
    """(the rule that can run on `n` distinct replies, why it is not the one named: "" if it is)."""
    if n < MIN_VOTES:
        return "unchanged", f"{n} distinct replies cannot outvote one node: the model is unchanged this round"
    if rule in ("krum", "multikrum") and n <= 2 * arg + 2:
        return "median", f"needs more than {2 * int(arg) + 2} distinct replies, got {n}: the median this round"
    if rule == "trimmed" and arg > 0 and int(arg * n) == 0:
        return "median", f"cuts nothing from {n} distinct replies: the median this round"
    return rule, ""


def robust(rule: str, arg: float, states: Sequence[State], weights: Sequence[float]) -> tuple[State, list[int]]:
    """(the model, the indices it is made of) by one of the robust rules."""
    if rule == "median":
        return coordinatewise(states, weights, median), list(range(len(states)))
    if rule == "trimmed":
        return coordinatewise(states, weights, lambda x: trimmed_mean(x, arg)), list(range(len(states)))
    kept = krum_select(states, int(arg), 1 if rule == "krum" else len(states) - int(arg))
    return weighted_average([states[i] for i in kept], [weights[i] for i in kept]), kept


def unchanged(template: State, reference: State | None) -> State:
    return {k: reference[k].clone() if reference is not None else torch.zeros_like(t) for k, t in template.items()}


@dataclasses.dataclass(frozen=True)
class Outcome:
    """An aggregation's result: the model, the rule that made it (`median` where Krum or the
    trimmed mean gave way, `unchanged` where too few distinct replies were left), the indices
    of the models it is made of, those of the updates clipped first, and why the rule is not
    the one the run names, or what it left out as a no-op or a copy ("" when nothing)."""

    state: State
    rule: str
    kept: list[int]
    clipped: list[int]
    note: str = ""

    def row(self, keys: Sequence[str]) -> dict[str, Any]:
        """A round's results fields under a robust rule: the rule that ran, why it is not the
        one the run names ("" when it is), and the keys of the nodes (`keys`, in the order the
        rule saw them) it left out or clipped."""
        return {
            "aggregation": self.rule,
            "aggregation_note": self.note,
            "left_out": [key for i, key in enumerate(keys) if i not in self.kept],
            "clipped": [keys[i] for i in self.clipped],
        }


@dataclasses.dataclass(frozen=True)
class Aggregator:
    """A run's aggregation: its rule (`aggregation`), clipping (`clip-norm`) and cap
    (`max-node-examples`)."""

    rule: str = "mean"  # as `aggregation` gives it: "median", "trimmed:0.2", ...
    clip_norm: float = 0.0
    max_node_examples: int = 0

    @classmethod
    def of(cls, cfg: RunConfig) -> Aggregator:
        return cls(cfg.aggregation, cfg.clip_norm, cfg.max_node_examples)

    @property
    def plain(self) -> bool:
        """Whether this is FedAvg's weighted mean with nothing else (what every run did before)."""
        return self.rule == "mean" and self.clip_norm == 0

    def weight(self, claimed: float, num_train: int) -> float:
        return node_weight(claimed, num_train, self.max_node_examples)

    def __call__(self, states: Sequence[State], weights: Sequence[float], reference: State | None = None) -> Outcome:
        """Combine `states` (one per node, in a fixed node order) with `weights`; `reference`
        is the model they started from (for `clip-norm` and no-op replies; zero when None)."""
        n, clipped = len(states), []
        rule, arg = parse_aggregation(self.rule)
        groups, noops = votes(states, reference) if rule != "mean" else ({}, [])
        if self.clip_norm > 0:
            states, clipped = clip_updates(states, reference, self.clip_norm)
        if not sum(weights) > 0:  # every node claims 0 examples: their mean would be NaN
            weights = [1.0] * n
        if rule == "mean":
            return Outcome(weighted_average(states, weights), rule, list(range(n)), clipped)
        voters = list(groups)
        used, why = gives_way(rule, arg, len(voters))
        if used == "unchanged":
            state, chosen = unchanged(states[0], reference), []
        else:
            state, picked = robust(used, arg, [states[i] for i in voters], capped([weights[i] for i in voters]))
            chosen = [voters[i] for i in picked]
        note = "; ".join(filter(None, [uncounted(len(noops), n - len(noops) - len(voters)), why]))
        if note:
            log.warning("aggregation %s: %s", self.rule, note)
        return Outcome(state, used, sorted(i for v in chosen for i in groups[v]), clipped, note)


def uncounted(noops: int, copies: int) -> str:
    """What a robust rule did not count, in words ("" when nothing)."""
    parts = []
    if noops:
        parts.append(f"{noops} repl{'y' if noops == 1 else 'ies'} equal to the model sent (no training) left out")
    if copies:
        parts.append(f"{copies} cop{'y' if copies == 1 else 'ies'} of another reply counted with it")
    return "; ".join(parts)
