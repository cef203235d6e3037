import numpy as np
import pytest

from florist.strategies.knnper import client as knn
from florist.strategies.knnper.datastore import Datastore


def test_knn_proba_by_hand():
    # one query, neighbours at squared distances 0 and 4 (Euclidean 0 and 2) with labels 2 and 0,
    # σ = 1: weights 1 and e^-4 (squared) or e^-2 (paper) → p = [w, 0, 1] / (1 + w)
    for kernel, w in (("squared", np.exp(-4)), ("paper", np.exp(-2))):
        p = knn.knn_proba(np.array([[0.0, 4.0]]), np.array([[2, 0]]), num_classes=3, sigma=1.0, kernel=kernel)
        assert np.allclose(p, [[w / (1 + w), 0, 1 / (1 + w)]])


def test_far_neighbours_do_not_underflow_to_nan():
    for kernel in ("paper", "squared"):
        p = knn.knn_proba(np.array([[5000.0, 5001.0]]), np.array([[1, 1]]), num_classes=2, sigma=1e-3, kernel=kernel)
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
    choice = knn.select(p_global, {(5, 1.0): p_knn}, y)
    assert choice.accuracy == 1.0 and choice.lam == 1.0  # every λ is 100% accurate; λ=1 has the least loss


def test_selection_prefers_accuracy_over_loss():
    y = np.array([0, 0, 1])
    p_global = np.array([[0.9, 0.1], [0.9, 0.1], [0.9, 0.1]])  # 2/3 right, low loss on two
    p_knn = np.array([[0.55, 0.45], [0.55, 0.45], [0.45, 0.55]])  # 3/3 right
    choice = knn.select(p_global, {(3, 1.0): p_knn}, y)
    assert choice.accuracy == 1.0  # λ = 0 has the lower loss on two points, but gets one wrong
    each = [knn.select(p_global, {(3, 1.0): p_knn}, y, lambdas=[lam]) for lam in knn.LAMBDA_GRID]
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
    choice = knn.select(p_global, {(5, 1.0): p_knn}, y)
    assert choice.lam == best and choice.accuracy == 1.0


def reference_proba(stored, labels, queries, k, sigma, kernel, num_classes=10):
    """p_kNN from its definition in float64, no FAISS and no shift: brute-force distances, the
    k nearest, each adding exp(−d/σ) (paper: d Euclidean) or exp(−d²/σ) (squared) to its label."""
    stored, queries = stored.astype(np.float64), queries.astype(np.float64)
    p = np.zeros((len(queries), num_classes))
    for row, query in zip(p, queries):
        squared = ((stored - query) ** 2).sum(1)
        distance = np.sqrt(squared) if kernel == "paper" else squared
        for i in np.argsort(squared, kind="stable")[:k]:
            row[labels[i]] += np.exp(-distance[i] / sigma)
    return p / p.sum(1, keepdims=True)


@pytest.fixture
def cloud():
    """Stored points and queries at distances where both kernels give soft, different votes."""
    rng = np.random.default_rng(3)
    stored = rng.normal(size=(300, 12)).astype(np.float32)
    return stored, rng.integers(0, 10, 300), rng.normal(size=(40, 12)).astype(np.float32)


@pytest.mark.parametrize("kernel", ["paper", "squared"])
def test_every_k_and_sigma_of_the_grid_is_the_float64_definition(make_node, cloud, kernel):
    """`proba_grid` searches FAISS once for the largest k and slices: each (k, σ) must equal the
    definition computed from scratch for that k and σ."""
    stored, labels, queries = cloud
    values = {"knn-select": "client", "knn-kernel": kernel, "knn-ks": "1,4,9", "knn-sigmas": "0.5,2,8"}
    node = make_node({"strategy": "knnper"} | values)
    store = Datastore(12)
    store.add(stored, labels)
    grid = knn.proba_grid(node, store, queries)
    assert sorted(grid) == [(k, s) for k in (1, 4, 9) for s in (0.5, 2.0, 8.0)]
    for (k, sigma), p in grid.items():
        np.testing.assert_allclose(p, reference_proba(stored, labels, queries, k, sigma, kernel), atol=1e-5)


def test_the_two_kernels_differ_where_the_test_above_checks_them(cloud):
    """The float64 test above could not tell a kernel that ignored `kernel` from a right one if
    both references agreed on its data: they do not."""
    stored, labels, queries = cloud
    paper, squared = (reference_proba(stored, labels, queries, 9, 2.0, kernel) for kernel in ("paper", "squared"))
    assert np.abs(paper - squared).max() > 0.05


@pytest.mark.parametrize(
    "bad",
    [np.full((50, 10), np.nan), np.full((1, 10), 0.1), np.full((50, 9), 1 / 9)],
    ids=["nan", "broadcasts", "classes"],
)
def test_lambda_zero_still_checks_p_knn(bad):
    """`if lam == 0: return p_global` would pass any p_kNN at λ = 0, a NaN or one that numpy
    broadcasts (1×C) or that has other classes: a broken kNN must fail whatever λ is chosen."""
    p_global = np.random.default_rng(0).dirichlet(np.ones(10), size=50)
    with pytest.raises(ValueError, match="p_kNN"):
        knn.mix(bad, p_global, 0.0)
