"""`inner-dirichlet:ALPHA`: equal-size clients whose label mixes are Dir(ALPHA) draws, at the
tiny α where a per-label Dirichlet cannot give every client data."""

import warnings

import datasets
import numpy as np
import pytest

from florist.common import data

LABELS = np.repeat(np.arange(10), [500, 480, 520, 500, 505, 495, 500, 500, 499, 501])


@pytest.mark.parametrize("alpha", [0.01, 0.1, 1.0, 1000.0])
@pytest.mark.parametrize("clients", [7, 100])
def test_every_row_goes_to_exactly_one_of_equal_size_clients(alpha, clients):
    parts = data.inner_dirichlet_indices(LABELS, clients, alpha, seed=3)
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(LABELS)))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_alpha_sets_how_skewed_each_clients_labels_are():
    """The mean share of a client's most frequent label: near 1 at α = 0.01, near 1/10 at α = 1000."""

    def top_share(alpha: float) -> float:
        parts = data.inner_dirichlet_indices(LABELS, 50, alpha, seed=1)
        return float(np.mean([np.bincount(LABELS[p]).max() / len(p) for p in parts]))

    shares = [top_share(a) for a in (0.01, 0.3, 1000.0)]
    assert shares[0] > 0.85 and shares[2] < 0.25 and shares[0] > shares[1] > shares[2]


def test_the_partitioner_serves_the_draw_through_flwr_datasets_and_is_seeded():
    rows = datasets.Dataset.from_dict({"label": LABELS, "index": np.arange(len(LABELS))})
    first, again, other = (data.make_partitioner("inner-dirichlet:0.01", 100, s, 10) for s in (1, 1, 2))
    for p in (first, again, other):
        p.dataset = rows
    assert first.num_partitions == 100
    assert first.load_partition(5)["index"] == again.load_partition(5)["index"] != other.load_partition(5)["index"]
    # the per-label Dirichlet at this α cannot give 100 clients 10 rows each: it gives up, in one
    # error, without flwr-datasets' warning at each of its attempts (florist silences that one)
    per_label = data.make_partitioner("dirichlet:0.01", 100, 1, 10)
    per_label.dataset = rows
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ValueError, match="max number of attempts"):
        warnings.simplefilter("always")
        per_label.load_partition(0)
    assert [str(w.message) for w in caught if "min_partition_size" in str(w.message)] == []


def test_an_embedded_run_can_use_it():
    parts = data.partition_indices("inner-dirichlet:0.01", 20, 1, 10, public_size=200)
    assert len(parts) == 20 and len({len(p) for p in parts}) <= 2 and min(map(len, parts)) >= 10
