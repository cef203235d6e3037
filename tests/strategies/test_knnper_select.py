"""kNN-Per's choice of (λ, k, σ) on small validation splits: `knn-select` = client | paper | shrunk."""

import numpy as np
import pytest

from florist.config import RunConfig
from florist.strategies.knnper import client as knn

PRIOR = (0.5, 10, 1.0)


def split(copies: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """`copies` × four validation points, two of each class. The global model says class 0 for
    all; p_kNN leans to the right class on each. The prior (λ = 0.5) gets the class-0 half
    right, λ ≥ 0.8 all of them: the data beat the prior by 2 × `copies` samples."""
    y = np.tile([0, 0, 1, 1], copies)
    p_global = np.tile([0.99, 0.01], (len(y), 1))
    p_knn = np.where(y[:, None] == 0, [1.0, 0.0], [0.3, 0.7])
    return y, p_global, {(10, 1.0): p_knn}


def test_the_split_is_what_its_docstring_says():
    y, p_global, by = split(1)
    assert knn.select(p_global, by, y, lambdas=(0.5,)).accuracy == 0.5
    assert knn.select(p_global, by, y).accuracy == 1.0 and knn.select(p_global, by, y).lam >= 0.8


def test_a_tiny_validation_split_keeps_the_prior():
    """Four digits beat the prior by two: too few to leave it (prior weight 5)."""
    y, p_global, by = split(1)
    choice = knn.select(p_global, by, y, prior=PRIOR, prior_weight=5)
    assert (choice.lam, choice.k, choice.sigma) == PRIOR and choice.accuracy == 0.5  # its own accuracy, not shrunk


def test_a_large_validation_split_follows_its_data():
    """200 digits beat the prior by 100: the split's own best wins, as without a prior."""
    y, p_global, by = split(50)
    choice = knn.select(p_global, by, y, prior=PRIOR, prior_weight=5)
    assert choice == knn.select(p_global, by, y) and choice.accuracy == 1.0 and choice.lam >= 0.8


@pytest.mark.parametrize(("weight", "kept"), [(6, True), (5.9, False), (0, False)])
def test_the_prior_weight_is_counted_in_validation_samples(weight, kept):
    """12 digits beat the prior by 6: a weight of 6 ties (the prior wins ties), less leaves it."""
    y, p_global, by = split(3)
    choice = knn.select(p_global, by, y, prior=PRIOR, prior_weight=weight)
    assert ((choice.lam, choice.k, choice.sigma) == PRIOR) == kept


def test_a_prior_off_the_lambda_grid_is_a_candidate_and_one_off_the_pairs_is_an_error():
    y, p_global, by = split(1)
    assert knn.select(p_global, by, y, prior=(0.55, 10, 1.0), prior_weight=5).lam == 0.55
    with pytest.raises(ValueError, match="needs p_kNN for k = 5"):
        knn.select(p_global, by, y, prior=(0.5, 5, 1.0), prior_weight=5)


def settings(**values):
    return RunConfig.from_mapping({"strategy": "knnper"} | values).settings


def test_each_selection_searches_its_own_k_and_sigma():
    grid = {"knn-ks": "3,5", "knn-sigmas": "1,2"}
    assert settings(**grid, **{"knn-select": "client"}).pairs == ((3, 1.0), (3, 2.0), (5, 1.0), (5, 2.0))
    assert settings(**grid, **{"knn-select": "shrunk"}).pairs[-1] == (10, 1.0)  # the prior's, off the grid
    assert settings(**grid, **{"knn-select": "paper", "knn-prior": "0.2,7,3"}).pairs == ((7, 3.0),)
    assert settings(**{"knn-select": "shrunk"}).pairs.count((10, 1.0)) == 1  # on the grid: once


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("knn-select", "pooled", "knn-select must be one of client, paper, shrunk"),
        ("knn-prior", "0.5,10", "knn-prior must be λ,k,σ"),
        ("knn-prior", "1.5,10,1", "knn-prior must be λ,k,σ"),
        ("knn-prior", "0.5,0,1", "knn-prior must be λ,k,σ"),
        ("knn-prior", "0.5,10,0", "knn-prior must be λ,k,σ"),
        ("knn-prior-weight", -1.0, "knn-prior-weight must be >= 0"),
    ],
)
def test_bad_selection_settings_are_refused_by_name(key, value, message):
    with pytest.raises(ValueError, match=message):
        settings(**{key: value})


@pytest.mark.parametrize("select", ["paper", "shrunk"])
def test_a_node_with_a_few_validation_digits_keeps_the_papers_k_and_sigma(make_node, select):
    """On a real node (untrained model, its handful of validation digits), `paper` and `shrunk`
    choose k and σ of the prior whatever the grids hold; `shrunk` keeps its λ too."""
    node = make_node({"strategy": "knnper", "knn-select": select, "knn-ks": "1,3", "knn-sigmas": "0.1"})
    model = node.new_model()
    choice = knn.choose(node, model, knn.datastore_for(node, model, "v1"))
    assert (choice.k, choice.sigma) == (10, 1.0) and len(node.data.y_val) <= 30
    assert select == "paper" or choice.lam == 0.5


def test_the_client_selection_is_the_grids_best(make_node):
    node = make_node({"strategy": "knnper", "knn-select": "client", "knn-ks": "1,3", "knn-sigmas": "0.1"})
    model = node.new_model()
    store = knn.datastore_for(node, model, "v1")
    assert knn.choose(node, model, store).k in (1, 3)
