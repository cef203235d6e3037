"""PerFed-CKT's public set P from another distribution than the clients' (`public-dataset`),
every cluster's view of it under `rotate:K` (`public-shift`), and the best-round accuracy a
run records beside its final one."""

import numpy as np
import pytest

from florist.common import data as data_lib
from florist.common import scenarios
from florist.config import RunConfig
from florist.server.report import best_round
from florist.server.results import round_accuracy
from florist.strategies.perfedckt import client as client_half
from florist.strategies.perfedckt import public
from florist.strategies.perfedckt.server import public_fingerprint


def _cfg(**values) -> RunConfig:
    return RunConfig.from_mapping({"strategy": "perfed-ckt"} | values)


def test_mnist_as_the_public_set_of_digits_clients_is_resized_to_their_input():
    x = public.public_set(_cfg(**{"public-dataset": "mnist5k"}), (1, 8, 8))
    assert x.shape == (200, 1, 8, 8) and x.dtype == np.float32 and 0 <= x.min() and x.max() <= 1
    same = public.public_set(_cfg(), (1, 8, 8))
    np.testing.assert_array_equal(same, data_lib.embedded_public(200, 1))  # today's P is unchanged
    assert data_lib.fingerprint(x) != data_lib.fingerprint(same)
    # 28×28 → 8×8 averages overlapping 4×4 areas: a blank border stays blank, the strokes stay.
    raw = data_lib.embedded_public(200, 1, "mnist5k")[0].astype(np.float32) / 255
    assert x[0].mean() == pytest.approx(raw.mean(), rel=0.15) and x[0].max() > 0.3
    up = public.public_set(_cfg(dataset="mnist5k", model="lenet", **{"public-dataset": "digits"}), (1, 28, 28))
    assert up.shape == (200, 1, 28, 28)
    assert data_lib.resize_images(raw[None], (3, 32, 32)).shape == (1, 3, 32, 32)  # gray to RGB clients


def test_a_node_trains_with_the_public_set_the_server_fingerprinted(make_node):
    values = {"strategy": "perfed-ckt", "public-dataset": "mnist5k", "ckt-steps": 2}
    node = make_node(values, key="partition-0")
    expected = public_fingerprint(node.cfg, (1, 8, 8))
    assert client_half.public_set(node, expected).shape == (200, 1, 8, 8)
    with pytest.raises(ValueError, match="public-dataset 'mnist5k'.* but the server expects"):
        client_half.public_set(node, public_fingerprint(_cfg(), (1, 8, 8)))


def test_under_rotate_k_the_public_set_holds_every_clusters_view():
    base = public.public_set(_cfg(), (1, 8, 8))
    x = public.public_set(_cfg(shift="rotate:4", **{"public-shift": "clients"}), (1, 8, 8))
    for k in range(4):
        np.testing.assert_array_equal(x[k::4], scenarios.rotate(base[k::4], 90.0 * k))
    upright = public.public_set(_cfg(shift="rotate:4"), (1, 8, 8))  # the default: P as it is
    np.testing.assert_array_equal(upright, base)
    np.testing.assert_array_equal(public.public_set(_cfg(shift="relabel:4"), (1, 8, 8)), base)  # labels: P has none


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"public-dataset": "cifar"}, "public-dataset 'cifar' is not one of"),
        ({"public-dataset": "uoft-cs/cifar100"}, "a hub id is not read as P yet"),
        ({"public-shift": "all"}, "public-shift must be one of clients, none"),
        ({"ckt-unseen": "never"}, "ckt-unseen must be rounds or paper"),
    ],
)
def test_public_settings_are_checked_at_start_up(values, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**values)


def test_the_best_and_the_last_evaluated_round_are_recorded():
    rounds = [{"round": r, "accuracy": a} for r, a in ((1, 0.5), (2, 0.8), (3, None), (4, 0.8), (5, 0.7))]
    figures = round_accuracy(rounds)
    assert figures == {"best": 0.8, "best_round": 2, "last": 0.7, "last_round": 5}  # a tie: the earliest
    assert "best 80.0% (round 2), last 70.0% (round 5)" in best_round({"round_accuracy": figures})[0]
    assert round_accuracy([{"round": 1, "accuracy": None}])["best"] is None
    assert best_round({}) == []  # results written before this figure existed
