"""Record-level dp's accounting (`dp = "record"`, docs/privacy.md "Record-level dp"): DP-SGD on every
node (Abadi et al., 2016), each step the Poisson-subsampled Gaussian mechanism at the node's rate q and
σ, composed by `dp-accounting`'s RDP and PLD accountants (the smaller bound reported, as in
`florist.common.privacy`), and σ calibrated for a node's budget. A node's ledger
(florist/client/ledger.py) asks it every round, so what does not change between rounds is kept: one
step's RDP curve and PLD per (q, σ), a round's self-composition, and the largest composition so far.
No torch here either."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from florist.common.privacy import ORDERS, PLD_INTERVAL, PLD_UPTO, _accountant, _event

# A node's ledger keeps how many steps it took at each (q, σ), q = batch-size / n: composed as one
# self-composed event per pair (composition commutes).
Steps = tuple[tuple[float, float, int], ...]  # (q, σ, steps) per pair


@functools.lru_cache(maxsize=4096)
def steps_spent(steps: Steps, delta: float, accountant: str = "rdp") -> float:
    """ε after `steps` ((q, σ, count) each) of DP-SGD, by one accountant: what its `compose` and
    `get_epsilon` of the self-composed events give, from one step's RDP curve or PLD per (q, σ),
    kept (a node's rounds differ only in the count: 25 ms a round where the accountant took 100)."""
    from dp_accounting.rdp import rdp_privacy_accountant

    steps = tuple((q, sigma, count) for q, sigma, count in steps if count > 0)
    if not steps:
        return 0.0
    if accountant == "rdp":
        rdp = sum(count * _step_rdp(q, sigma) for q, sigma, count in steps)
        return float(rdp_privacy_accountant.compute_epsilon(ORDERS, rdp, delta)[0])
    composed = None
    for q, sigma, count in steps:
        pld = _steps_pld(q, sigma, count)
        composed = pld if composed is None else composed.compose(pld)
    return float(composed.get_epsilon_for_delta(delta))


_COMPOSED: dict[tuple[float, float], tuple[int, Any]] = {}  # (q, σ) -> the largest count composed so far, its PLD


def _steps_pld(q: float, sigma: float, count: int):
    """The PLD of `count` steps at (q, σ): the largest count composed before in this process, composed
    with the steps since (a node's next round: a third of the self-composition's time), else composed
    anew. Either is dp-accounting's pessimistic composition of the same distributions."""
    done, pld = _COMPOSED.get((q, sigma), (0, None))
    if pld is None or done > count:
        pld = _self_composed(q, sigma, count)
    elif done < count:
        pld = pld.compose(_self_composed(q, sigma, count - done))
    if count >= done:
        _COMPOSED.pop((q, sigma), None)
        _COMPOSED[(q, sigma)] = (count, pld)
        while len(_COMPOSED) > 64:  # the oldest pair out
            del _COMPOSED[next(iter(_COMPOSED))]
    return pld


@functools.lru_cache(maxsize=64)
def _step_rdp(q: float, sigma: float) -> np.ndarray:
    """One DP-SGD step's RDP at each of ORDERS (RDP composes by adding)."""
    ledger = _accountant("rdp")
    ledger.compose(_event(sigma, q, 1))
    return ledger.rdp


@functools.lru_cache(maxsize=64)
def _self_composed(q: float, sigma: float, count: int):
    """`count` steps' PLD at (q, σ), self-composed (a round's, the same each round)."""
    return _step_pld(q, sigma).self_compose(count)


@functools.lru_cache(maxsize=64)
def _step_pld(q: float, sigma: float):
    """One DP-SGD step's privacy loss distribution, as dp-accounting's PLD accountant makes it
    (add/remove neighbours, PLD_INTERVAL, pessimistic)."""
    from dp_accounting.pld import privacy_loss_distribution

    _accountant()  # quiets absl
    sampled = {"sampling_prob": q} if q < 1 else {}
    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=sigma, value_discretization_interval=PLD_INTERVAL, **sampled
    )


def steps_tightest(steps: Steps, delta: float) -> tuple[float, str]:
    """(ε, accountant) after `steps`: the smaller of RDP's and PLD's bounds, each valid."""
    rdp = steps_spent(steps, delta, "rdp")
    if rdp > PLD_UPTO:
        return rdp, "rdp"
    return min((rdp, "rdp"), (steps_spent(steps, delta, "pld"), "pld"))


@functools.lru_cache(maxsize=256)
def record_sigma(target: float, delta: float, q: float, steps: int) -> tuple[float, str]:
    """(σ, accountant): the smallest noise multiplier with which `steps` DP-SGD steps at rate `q` spend
    `target` ε at `delta`, by whichever accountant needs less (PLD, where ε is small enough for it).
    Each node calibrates once a run, so it is made cheap: both searches stop within 10⁻⁴ of σ (on the side
    that keeps ε within `target`), PLD's starts from RDP's σ (PLD's is 5-8 % below it) and searches on a
    10× coarser grid (pessimistic: a little more ε, so a σ up to 0.3 % larger), its σ then checked on
    the fine grid the ledger counts with (searched there when the check fails). 0.5 s of CPU, not 2."""
    import dp_accounting
    from dp_accounting import pld as pld_lib

    def search(fresh, bracket, tol: float) -> float:
        make = lambda sigma: _event(sigma, q, steps)  # noqa: E731
        return float(dp_accounting.calibrate_dp_mechanism(fresh, make, target, delta, bracket, tol=tol))

    rdp = search(lambda: _accountant("rdp"), dp_accounting.LowerEndpointAndGuess(0.0, 1.0), 1e-4)
    if target > PLD_UPTO:
        return rdp, "rdp"
    coarse = lambda: pld_lib.PLDAccountant(value_discretization_interval=10 * PLD_INTERVAL)  # noqa: E731
    try:
        sigma = search(coarse, dp_accounting.ExplicitBracketInterval(0.5 * rdp, rdp), 1e-4 * rdp)
        if steps_spent(((q, sigma, steps),), delta, "pld") > target:  # the coarse grid was not the more pessimistic
            sigma = search(lambda: _accountant("pld"), dp_accounting.ExplicitBracketInterval(sigma, rdp), 1e-4 * rdp)
    except (ValueError, dp_accounting.mechanism_calibration.NoBracketIntervalFoundError):  # PLD needs RDP's or more
        return rdp, "rdp"
    return min((rdp, "rdp"), (sigma, "pld"))
