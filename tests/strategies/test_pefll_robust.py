"""PeFLL's (and OD-PFL's) server half against one lying node: the descriptor standardizer
(`hn-standardize`) is fitted so that neither a degenerate descriptor nor the node's place in
the order chooses it, and a robust `aggregation` leaves the same fields in each round's row as
FedAvg's (`aggregation`, `left_out`, `clipped`)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from florist.apps.client import build_client_app
from florist.apps.server import server_half
from florist.common.client_mods import attack
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.strategies.pefll.networks import Standardizer

LIAR = 100  # node id of partition 0, the first node in key order
FIVE = {
    "strategy": "pefll",
    "num-server-rounds": 4,
    "partition": "iid",
    "unseen-fraction": 0.0,
    "min-nodes": 5,
    "eval-every": 0,
    "seed": 1,
    "hn-standardize": True,
    "aggregation": "median",
    "hn-local-steps": 20,
}


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """`federation(attacked, **settings)`: the results of a five-node PeFLL run (cached)."""
    cache: dict[tuple, dict] = {}

    def run(attacked: bool = False, **settings) -> dict:
        key = (attacked, tuple(sorted(settings.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp("pefll-robust")
            cfg = RunConfig.from_mapping(FIVE | settings | {"results-dir": str(folder)})
            app = build_client_app([attack("standardizer")]) if attacked else None
            cache[key] = run_in_process(cfg, 5, client_app=app)
        return cache[key]

    return run


def accuracy(results: dict) -> float:
    return 100 * results["summary"]["seen"]["mean_accuracy"]


def test_a_degenerate_descriptor_from_the_first_node_does_not_choose_the_standardizer(federation):
    """Fitted on the first descriptor alone (the authors' rule), s came from [1e-10, 0, …]:
    every honest θ = h((v − m)/s) diverged and the run stopped in round 1."""
    honest, attacked = federation(), federation(attacked=True)
    assert attacked["complete"]
    assert all(math.isfinite(row["train_loss"]) for row in attacked["rounds"])
    assert not {f["node_id"] for f in attacked["failures"]} - {LIAR}  # no honest node blamed
    assert accuracy(attacked) >= accuracy(honest) - 5


@pytest.mark.parametrize("attacked", [False, True])
def test_every_round_row_names_the_rule_and_the_nodes_it_left_out_or_clipped(federation, attacked):
    rows = federation(attacked)["rounds"]
    assert len(rows) == FIVE["num-server-rounds"]
    for row in rows:
        assert row["aggregation"] == "median" and row["left_out"] == [] and row["clipped"] == []
    krum = federation(attacked, aggregation="krum:1", **{"num-server-rounds": 1, "clip-norm": 1e-6})
    [row] = krum["rounds"]
    assert row["aggregation"] == "krum" and len(row["left_out"]) == 4
    assert set(row["left_out"]) < {f"partition-{i}" for i in range(5)}
    assert sorted(row["clipped"]) == [f"partition-{i}" for i in range(5)]  # every ‖g_i‖ exceeds 1e-6


def test_odpfl_rows_carry_the_same_fields(federation):
    [row] = federation(strategy="odpfl", aggregation="trimmed:0.2", **{"num-server-rounds": 1})["rounds"]
    assert row["aggregation"] == "trimmed" and row["left_out"] == [] and row["clipped"] == []


def test_a_round_the_rule_leaves_unchanged_takes_no_step():
    """Two replies cannot outvote one node: the rule keeps nobody, and the networks stay as
    they are (an Adam step on a zero gradient would still move them)."""
    cfg = RunConfig.from_mapping({"strategy": "pefll", "hn-embed-dim": 3, "aggregation": "median"})
    server = server_half("pefll")(cfg, None, (1, 8, 8), 2)
    before = {k: v.clone() for k, v in server.hyper.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    steps = {}
    for node in (1, 2):
        theta = server.hyper(torch.randn(3, generator=generator))
        delta = {k: torch.randn(t.shape, generator=generator) for k, t in theta.items()}
        steps[node] = (theta, delta, {k: torch.randn(p.shape) for k, p in server.embed.named_parameters()})
    outcome = server.update(steps)
    assert outcome.kept == []
    for key, value in server.hyper.state_dict().items():
        assert torch.equal(value, before[key]), key


# -- the standardizer's fit ----------------------------------------------------------------


def _fitted(rows: torch.Tensor) -> tuple[float, float]:
    standardizer = Standardizer(True)
    standardizer.fit(rows)
    return float(standardizer.shift), float(standardizer.scale)


def test_one_node_s_descriptor_gives_the_authors_mean_and_standard_deviation():
    v = torch.tensor([1.0, 2.0, 6.0])
    m, s = _fitted(v[None])
    assert m == pytest.approx(3.0) and s == pytest.approx(float(v.std()))


def test_the_fit_is_the_median_of_each_node_s_statistics_whatever_their_order():
    honest = torch.tensor([[0.1, -0.2, 0.3, 0.05], [0.12, -0.25, 0.28, 0.0], [0.08, -0.18, 0.33, 0.1]])
    means, stds = honest.mean(1), honest.std(1)
    liar = torch.tensor([[1e-10, 0.0, 0.0, 0.0]])
    orders = [list(p) for p in itertools.permutations(range(4))]
    fits = {_fitted(torch.cat([honest, liar])[order]) for order in orders}
    assert len(fits) == 1  # the order plays no part
    m, s = fits.pop()
    assert means.min() <= m <= means.max() and stds.min() <= s <= stds.max()  # within the honest nodes' values
    huge = torch.tensor([[1e30, -1e30, 1e30, -1e30]])
    m, s = _fitted(torch.cat([huge, honest]))
    assert means.min() <= m <= means.max() and stds.min() <= s <= stds.max()


def test_of_two_nodes_the_liar_can_halve_s_at_most():
    honest, liar = torch.tensor([[1.0, 2.0, 6.0]]), torch.tensor([[1e-10, 0.0, 0.0]])
    _, s = _fitted(torch.cat([liar, honest]))
    assert s >= float(honest.std()) / 2


def test_the_scale_is_floored_at_a_hundredth_of_the_descriptors_size():
    nearly_constant = torch.tensor([[5.0, 5.0 + 1e-6, 5.0], [5.0, 5.0, 5.0 - 1e-6], [5.0, 5.0, 5.0]])
    assert _fitted(nearly_constant)[1] == pytest.approx(0.05)
    assert _fitted(torch.zeros(3, 4)) == (0.0, 1.0)  # all zero: s = 1
    assert _fitted(torch.tensor([[2.0], [4.0], [9.0]])) == (4.0, 1.0)  # one component: no spread, s = 1


def test_an_unfitted_standardizer_is_refused_and_a_fitted_one_survives_a_checkpoint():
    with pytest.raises(RuntimeError, match="before fit"):
        Standardizer(True)(torch.ones(3))
    standardizer = Standardizer(True)
    standardizer.fit(torch.tensor([[1.0, 2.0, 6.0], [0.0, 1.0, 5.0], [2.0, 3.0, 7.0]]))
    again = Standardizer(True)
    again.load_state_dict(standardizer.state_dict())
    v = torch.tensor([3.0, -1.0, 0.0])
    torch.testing.assert_close(again(v), standardizer(v))
    assert torch.equal(Standardizer(False)(v), v)


# -- per component (`hn-standardize-components`) --------------------------------------------


def _components(rows: torch.Tensor) -> Standardizer:
    standardizer = Standardizer(False, per_component=True)
    standardizer.fit(rows)
    return standardizer


def test_per_component_m_and_s_are_each_components_median_and_mad_over_the_nodes():
    rows = torch.tensor([[1.0, 10.0, 0.0], [2.0, 10.5, 0.0], [4.0, 9.0, 0.0], [3.0, 11.0, 0.0]])
    fitted = _components(rows)
    m = torch.tensor([2.5, 10.25, 0.0])  # numpy's median: the two middle values' mean
    mad = torch.tensor([1.0, 0.5, 0.0]) * 1.4826  # the median of |v − m|, as a normal's σ
    floor = 0.1 * float(torch.tensor(sorted(rows.square().mean(1).sqrt().tolist())[1:3]).mean())
    torch.testing.assert_close(fitted.shift, m)
    torch.testing.assert_close(fitted.scale, mad.clamp_min(floor))  # the constant component: the floor
    v = torch.tensor([3.0, 12.0, 1.0])
    torch.testing.assert_close(fitted(v), (v - m) / mad.clamp_min(floor))
    # what h reads differs between nodes at unit scale, where the raw rows barely did
    assert float(fitted(rows[0]).sub(fitted(rows[2])).abs()[:2].min()) > 1.0


def test_one_lying_node_cannot_move_any_component_outside_the_honest_nodes_values():
    honest = torch.tensor([[0.1, -0.2, 0.3, 0.05], [0.12, -0.25, 0.28, 0.0], [0.08, -0.18, 0.33, 0.1]])
    for liar in (torch.full((1, 4), 1e30), torch.tensor([[1e-10, 0.0, 0.0, 0.0]])):
        fits = {
            tuple(_components(torch.cat([honest, liar])[list(o)]).shift.tolist())
            for o in itertools.permutations(range(4))
        }
        assert len(fits) == 1  # the order plays no part
        shift = torch.tensor(fits.pop())
        assert (honest.min(0).values <= shift).all() and (shift <= honest.max(0).values).all()
        scale = _components(torch.cat([honest, liar])).scale
        assert (scale <= (honest.max(0).values - honest.min(0).values) * 1.4826 + 0.1).all()  # not blown up


def test_a_per_component_fit_survives_a_checkpoint_into_a_fresh_standardizer():
    fitted = _components(torch.tensor([[1.0, 2.0, 6.0], [0.0, 1.0, 5.0], [2.0, 3.5, 7.0]]))
    again = Standardizer(False, per_component=True)
    again.load_state_dict(fitted.state_dict())  # vectors into the scalar buffers a fresh one has
    v = torch.tensor([3.0, -1.0, 0.0])
    torch.testing.assert_close(again(v), fitted(v))
    assert again.shift.shape == (3,)


def test_the_two_standardizations_are_refused_together_in_one_line():
    with pytest.raises(ValueError, match="set one"):
        RunConfig.from_mapping({"strategy": "pefll", "hn-standardize": True, "hn-standardize-components": True})


def test_two_colluders_of_five_cannot_move_any_component_outside_the_honest_nodes_values():
    honest = torch.tensor([[0.1, -0.2, 0.3], [0.12, -0.25, 0.28], [0.08, -0.18, 0.33]])
    for liars in (torch.full((2, 3), 1e30), torch.tensor([[1e30] * 3, [-1e30] * 3]), torch.zeros(2, 3)):
        fitted = _components(torch.cat([liars, honest]))
        assert (honest.min(0).values <= fitted.shift).all() and (fitted.shift <= honest.max(0).values).all()
        spread = honest.max(0).values - honest.min(0).values
        assert (fitted.scale <= spread * 1.4826 + 0.1 * honest.square().mean(1).sqrt().max()).all()
