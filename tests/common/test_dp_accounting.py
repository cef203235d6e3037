"""The accountant and the Gaussian mechanism (florist/common/privacy.py): σ and ε agree with a
second, independent accountant (Opacus's RDP), the noise has the std it claims, clipping bounds
every update, and integer buffers are never noised."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from florist.common import privacy

CASES = [(3.0, 1e-5, 0.5, 30), (1.0, 1e-5, 0.2, 100), (8.0, 1e-5, 1.0, 20), (3.0, 1e-5, 0.1, 200)]


@pytest.mark.parametrize("target, delta, q, rounds", CASES)
def test_the_noise_multiplier_matches_opacus_within_one_percent(target, delta, q, rounds):
    from opacus.accountants.utils import get_noise_multiplier

    ours = privacy.noise_multiplier(target, delta, q, rounds)
    theirs = get_noise_multiplier(
        target_epsilon=target,
        target_delta=delta,
        sample_rate=q,
        steps=rounds,
        accountant="rdp",
        epsilon_tolerance=0.001,
    )
    assert ours == pytest.approx(theirs, rel=0.01)
    assert privacy.epsilon(ours, q, rounds, delta) <= target  # calibrated never to overspend
    assert privacy.epsilon(ours, q, rounds, delta) == pytest.approx(target, rel=1e-3)


@pytest.mark.parametrize("sigma, q, rounds", [(1.0, 0.5, 30), (2.0, 0.1, 200), (4.29, 1.0, 10)])
def test_epsilon_spent_matches_opacus_within_one_percent(sigma, q, rounds):
    from opacus.accountants import RDPAccountant

    theirs = RDPAccountant()
    theirs.history = [(sigma, q, rounds)]
    assert privacy.epsilon(sigma, q, rounds, 1e-5) == pytest.approx(theirs.get_epsilon(1e-5), rel=0.01)


def plan(mode="central", clip=1.0, sigma=2.0, cap=math.inf, q=1.0) -> privacy.Plan:
    return privacy.Plan(mode, clip, sigma, 1e-5, cap, q)


def state(value: float, size: int = 4) -> dict[str, torch.Tensor]:
    return {"w": torch.full((size,), value), "bn.running_var": torch.ones(2), "n": torch.tensor(7)}


def test_the_local_noise_on_a_zero_update_has_std_sigma_times_c():
    start = state(0.0, 200_000)
    out = privacy.local_update(start, start, plan(clip=0.5, sigma=3.0), privacy.noise_generator(1, 1))
    assert out["w"].double().std().item() == pytest.approx(1.5, rel=0.02)
    assert out["w"].double().mean().item() == pytest.approx(0.0, abs=0.02)
    assert torch.equal(out["n"], start["n"]) and out["w"].dtype == torch.float32


def test_the_central_noise_on_zero_updates_has_std_sigma_c_over_the_nodes_sampled():
    start = state(0.0, 200_000)
    out, clipped = privacy.central_mean([start] * 3, start, 4, plan(clip=2.0, sigma=1.5), privacy.noise_generator(5))
    assert out["w"].double().std().item() == pytest.approx(1.5 * 2.0 / 4, rel=0.02) and clipped == 0
    again, _ = privacy.central_mean([start] * 3, start, 4, plan(clip=2.0, sigma=1.5), privacy.noise_generator(5))
    assert torch.equal(out["w"], again["w"])  # a set dp-noise-seed repeats the run
    fresh, _ = privacy.central_mean([start] * 3, start, 4, plan(clip=2.0, sigma=1.5), privacy.noise_generator(0))
    assert not torch.equal(out["w"], fresh["w"])  # seed 0: the OS's entropy


def test_clipping_bounds_each_update_and_leaves_small_ones_alone():
    start = state(1.0)
    big, small = state(101.0), state(1.01)  # updates of w of norm 200 and 0.02
    out, clipped = privacy.central_mean([big, small], start, 2, plan(clip=1.0, sigma=0.0), privacy.noise_generator(1))
    delta = privacy.update(out, start)
    assert clipped == 1
    expected = (100 / 200 + 0.01) / 2  # big clipped to norm 1 (0.5 a coordinate), small as sent
    assert np.allclose(delta["w"], expected) and privacy.norm(delta) <= 1.0
    alone, _ = privacy.clip(privacy.update(big, start), 1.0)
    assert privacy.norm(alone) == pytest.approx(1.0)


def test_noise_never_leaves_a_running_variance_negative_nor_touches_integer_buffers():
    start = state(0.0)
    start["bn.running_var"] = torch.zeros(1000)
    out = privacy.local_update(start, start, plan(sigma=5.0), privacy.noise_generator(3))
    assert out["bn.running_var"].min() >= 0 and out["bn.running_var"].max() > 0
    assert torch.equal(out["n"], torch.tensor(7))


def run_config(**values):
    base = dict(dp="central", dp_clip=1.0, dp_epsilon=math.inf, dp_delta=1e-5, dp_noise_multiplier=0.0)
    return types.SimpleNamespace(num_server_rounds=30, **(base | values))


def test_a_plan_spends_its_epsilon_exactly_over_the_run_or_caps_a_given_sigma():
    calibrated = privacy.Plan.of(run_config(dp_epsilon=3.0), q=0.5)
    assert calibrated.spent(30) == pytest.approx(3.0, rel=1e-3) and calibrated.stop_before(30) == ""
    local = privacy.Plan.of(run_config(dp="local", dp_epsilon=3.0), q=0.5)
    assert local.q == 1.0 and local.sigma > calibrated.sigma  # a node's own data, every round
    capped = privacy.Plan.of(run_config(dp_noise_multiplier=1.0, dp_epsilon=3.0), q=0.5)
    first = next(r for r in range(1, 31) if capped.spent(r) > 3.0)
    assert capped.stop_before(first - 1) == ""
    assert capped.stop_before(first).startswith(f"dp: round {first} would spend ε = ")
    assert f"training stops after round {first - 1}" in capped.stop_before(first)
    assert privacy.Plan.of(run_config(dp_noise_multiplier=1.0)).stop_before(10**4) == ""  # no cap
