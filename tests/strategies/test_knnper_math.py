import numpy as np
import pytest

from florist.strategies.knnper import client as knn


def test_knn_proba_by_hand():
    # one query, neighbours at squared distances 0 and 1 with labels 2 and 0, σ = 1:
    # weights 1 and e^-1 → p = [e^-1, 0, 1] / (1 + e^-1)
    p = knn.knn_proba(np.array([[0.0, 1.0]]), np.array([[2, 0]]), num_classes=3, sigma=1.0)
    z = 1 + np.exp(-1)
    assert np.allclose(p, [[np.exp(-1) / z, 0, 1 / z]])


def test_far_neighbours_do_not_underflow_to_nan():
    p = knn.knn_proba(np.array([[5000.0, 5001.0]]), np.array([[1, 1]]), num_classes=2, sigma=0.1)
    assert np.allclose(p, [[0.0, 1.0]])


def test_lambda_zero_is_the_global_model_exactly():
    rng = np.random.default_rng(0)
    p_global = rng.dirichlet(np.ones(10), size=50)
    p_knn = rng.dirichlet(np.ones(10), size=50)
    assert np.array_equal(knn.mix(p_knn, p_global, 0.0), p_global)  # computed, not short-circuited
    assert np.array_equal(knn.mix(p_knn, p_global, 1.0), p_knn)
    assert np.allclose(knn.mix(p_knn, p_global, 0.3).sum(1), 1.0)  # a probability, not a logit mix


def test_ties_on_accuracy_are_broken_by_log_loss():
    y = np.array([0, 1])
    p_global = np.array([[0.6, 0.4], [0.4, 0.6]])  # right, but unsure
    p_knn = np.array([[1.0, 0.0], [0.0, 1.0]])  # right and sure
    choice = knn.select(p_global, {5: p_knn}, y)
    assert choice.accuracy == 1.0 and choice.lam == 1.0  # every λ is 100% accurate; λ=1 has the least loss


def test_selection_prefers_accuracy_over_loss():
    y = np.array([0, 0, 1])
    p_global = np.array([[0.9, 0.1], [0.9, 0.1], [0.9, 0.1]])  # 2/3 right, low loss on two
    p_knn = np.array([[0.55, 0.45], [0.55, 0.45], [0.45, 0.55]])  # 3/3 right
    choice = knn.select(p_global, {3: p_knn}, y)
    assert choice.accuracy == 1.0  # λ = 0 has the lower loss on two points, but gets one wrong
    each = [knn.select(p_global, {3: p_knn}, y, lambdas=[lam]) for lam in knn.LAMBDA_GRID]
    assert choice.loss == min(c.loss for c in each if c.accuracy == 1.0)  # the least log-loss among the best


@pytest.mark.parametrize("best", [0.3, 0.6, 0.9])
def test_selection_finds_the_least_log_loss_inside_the_grid(best):
    """Two validation points of class 0: p_kNN is sure of the first, p_global of the second.
    Their mixed probabilities 0.6 + 0.4λ and 1 − cλ (c < 1/2: every λ gets both right) make the
    log-loss −log(0.6 + 0.4λ) − log(1 − cλ), convex in λ, least at λ* = (0.4 − 0.6c) / (0.8c);
    with c = 0.4 / (0.6 + 0.8λ*) that is the grid point λ*, and select must find it."""
    c = 0.4 / (0.6 + 0.8 * best)
    y = np.array([0, 0])
    p_global = np.array([[0.6, 0.4], [1.0, 0.0]])
    p_knn = np.array([[1.0, 0.0], [1 - c, c]])
    choice = knn.select(p_global, {5: p_knn}, y)
    assert choice.lam == best and choice.accuracy == 1.0
