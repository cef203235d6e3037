"""OD-PFL's Gaussian mechanism against the definition of (ε, δ)-differential privacy: every σ a
node would use meets the mechanism's exact condition, and the analytic σ is the least that does."""

import math

import numpy as np
import pytest

from florist.strategies.pefll.client import analytic_sigma, classic_sigma, gaussian_sigma

EPSILONS, DELTAS = (0.1, 0.5, 1.0, 3.0, 10.0), (1e-5, 1e-3)
SIZE = 50  # |D|: the descriptor averages 50 unit vectors, so Δ = 2/50
SENSITIVITY = 2 / SIZE
GRID = [(epsilon, delta) for epsilon in EPSILONS for delta in DELTAS]


def exact_delta(sigma: float, epsilon: float, sensitivity: float) -> float:
    """δ(ε) of N(0, σ²) noise on a query of sensitivity Δ, from its privacy loss L ~ N(μ, 2μ),
    μ = Δ²/2σ²: P[L > ε] − e^ε·P[L < −ε] (Balle & Wang 2018, Theorem 8); another form than the
    implementation's, itself checked against the definition (`hockey_stick`)."""
    mu = sensitivity**2 / (2 * sigma**2)

    def below(x: float) -> float:  # P[L < x] by erfc: statistics.NormalDist's 1 + erf loses the far tail
        return 0.5 * math.erfc((mu - x) / (2 * math.sqrt(mu)))

    low = below(-epsilon)  # 0 when it underflows: δ is then overstated, never understated
    return below(2 * mu - epsilon) - (math.exp(epsilon + math.log(low)) if low > 0 else 0.0)


def hockey_stick(sigma: float, epsilon: float, sensitivity: float) -> float:
    """The definition: ∫ max(0, p(x) − e^ε·q(x)) dx for p = N(0, σ²), q = N(Δ, σ²), on a grid."""
    x = np.linspace(-40 * sigma, sensitivity + 40 * sigma, 400_001)
    p, q = (np.exp(-((x - m) ** 2) / (2 * sigma**2)) / (sigma * math.sqrt(2 * math.pi)) for m in (0, sensitivity))
    return float(np.trapezoid(np.maximum(0.0, p - math.exp(epsilon) * q), x))


@pytest.mark.parametrize(("sigma", "epsilon"), [(0.05, 1.0), (0.02, 3.0), (0.2, 0.5), (0.02, 10.0)])
def test_the_closed_form_is_the_definition(sigma, epsilon):
    assert exact_delta(sigma, epsilon, SENSITIVITY) == pytest.approx(
        hockey_stick(sigma, epsilon, SENSITIVITY), rel=1e-4, abs=1e-12
    )


@pytest.mark.parametrize(("epsilon", "delta"), GRID)
def test_the_sigma_a_node_uses_is_epsilon_delta_private(epsilon, delta):
    assert exact_delta(gaussian_sigma(epsilon, delta, SIZE), epsilon, SENSITIVITY) <= delta * (1 + 1e-9)


@pytest.mark.parametrize(("epsilon", "delta"), GRID)
def test_the_analytic_sigma_is_the_least_private_one(epsilon, delta):
    sigma = analytic_sigma(epsilon, delta, SENSITIVITY)
    assert exact_delta(sigma, epsilon, SENSITIVITY) <= delta * (1 + 1e-9)
    assert exact_delta(sigma * (1 - 1e-3), epsilon, SENSITIVITY) > delta


@pytest.mark.parametrize(("epsilon", "delta"), [(e, d) for e, d in GRID if e < 1])
def test_the_classic_sigma_below_one_is_private_but_not_least(epsilon, delta):
    classic = classic_sigma(epsilon, delta, SENSITIVITY)
    assert exact_delta(classic, epsilon, SENSITIVITY) <= delta
    assert gaussian_sigma(epsilon, delta, SIZE) == classic
    assert analytic_sigma(epsilon, delta, SENSITIVITY) < classic


def test_the_classic_sigma_fails_at_large_epsilon_so_it_is_not_used_there():
    assert exact_delta(classic_sigma(10.0, 1e-5, SENSITIVITY), 10.0, SENSITIVITY) > 1e-5
    assert gaussian_sigma(10.0, 1e-5, SIZE) == analytic_sigma(10.0, 1e-5, SENSITIVITY)


def test_huge_epsilon_still_gives_a_finite_private_sigma():
    sigma = gaussian_sigma(1000.0, 1e-5, SIZE)
    assert 0 < sigma < SENSITIVITY and exact_delta(sigma, 1000.0, SENSITIVITY) <= 1e-5
