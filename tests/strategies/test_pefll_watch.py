"""PeFLL says, in one warning line, when its descriptors do not tell the nodes apart: under
concept shift (`relabel:K` on an iid split) the encoder alone gives every node nearly the
same model, a third right, and the run said nothing; where the label mixes differ, or the
class means (on by default) tell the clusters apart, it stays quiet. The statistic is each
round's `descriptor_between` (the between-node share of what h reads)."""

from __future__ import annotations

import logging

import pytest
import torch

from florist.apps.server import server_half
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.strategies.pefll.server import between_share

SMALL = {
    "strategy": "pefll",
    "num-server-rounds": 3,  # the watched round is the fifth or, in a shorter run, the last
    "unseen-fraction": 0.0,
    "min-nodes": 6,
    "eval-every": 0,
    "seed": 1,
    "hn-local-steps": 5,
}


def _warnings(caplog, tmp_path, **settings) -> tuple[list[str], dict]:
    cfg = RunConfig.from_mapping(SMALL | settings | {"results-dir": str(tmp_path)})
    with caplog.at_level(logging.WARNING, logger="flwr"):
        results = run_in_process(cfg, 6)
    return [r.getMessage() for r in caplog.records if "descriptors hardly differ" in r.getMessage()], results


def test_concept_shift_without_class_means_warns_once_naming_them(caplog, tmp_path):
    said, results = _warnings(caplog, tmp_path, partition="iid", shift="relabel:3", **{"hn-class-means": False})
    assert len(said) == 1 and "set hn-class-means=true" in said[0] and "\n" not in said[0]
    assert results["rounds"][-1]["descriptor_between"] < 1e-3


def test_concept_shift_with_class_means_is_separated_and_says_nothing(caplog, tmp_path):
    said, results = _warnings(caplog, tmp_path, partition="iid", shift="relabel:3")
    assert said == []
    assert results["rounds"][-1]["descriptor_between"] > 0.1 and results["rounds"][-1]["class_means_weight"] > 0.3


def test_a_label_skewed_split_is_separated_and_says_nothing(caplog, tmp_path):
    said, results = _warnings(caplog, tmp_path, partition="pathological:2")
    assert said == []
    assert results["rounds"][-1]["descriptor_between"] > 1e-3


def test_the_between_share_is_zero_for_equal_descriptors_and_one_for_opposite_ones():
    v = torch.tensor([1.0, -2.0, 3.0])
    assert between_share([v, v, v]) == 0.0
    assert between_share([v, -v]) == pytest.approx(1.0)
    assert between_share([torch.zeros(3), torch.zeros(3)]) == 0.0


@pytest.mark.parametrize(
    ("strategy", "encoder", "class_means", "hint"),
    [
        ("pefll", "label-channels", False, "set hn-class-means=true"),
        ("pefll", "label-channels", True, 'try hn-encoder="slots"'),
        ("pefll", "slots", True, "add hn-standardize-components=true hn-grad-clip=50"),
        ("odpfl", "label-channels", True, "use pefll, whose class means tell them apart"),
    ],
)
def test_the_warning_comes_once_at_round_five_and_names_what_to_try(caplog, strategy, encoder, class_means, hint):
    settings = {"hn-encoder": encoder, "hn-class-means": class_means, "num-server-rounds": 30}
    cfg = RunConfig.from_mapping({"strategy": strategy} | settings)
    server = server_half(strategy)(cfg, None, (1, 8, 8), 2)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        server.watch(5, 0.01)  # separated: nothing said
        for server_round in range(1, 31):
            server.watch(server_round, 1e-5)
    [said] = [r.getMessage() for r in caplog.records]
    assert "round 5" in said and hint in said and said.startswith(strategy)
