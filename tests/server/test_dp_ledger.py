"""Server-side ε that counts what was released (docs/privacy.md#accounting): under central dp with
fraction-train < 1 the sample is Poisson and drawn from the OS, never replayable from the run's
seed, and results.json says how many trained, not who; ε is composed round by round over the
checkpoint's ledger, so a resume with more nodes adds and never recomputes; PLD stands beside RDP;
each mechanism says its neighbouring relation; seeded noise reports no ε."""

from __future__ import annotations

import json
import math

import pytest
import torch

from florist.common import privacy
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.server import results as results_module
from florist.server.accounting import Ledger
from florist.server.strategy import NodeInfo
from florist.strategies.fedavg.server import FedAvg

SHAPE = (1, 8, 8)
CENTRAL = {"strategy": "fedavg", "dp": "central", "dp-noise-multiplier": 1.0}


def server(num_seen: int, **values) -> FedAvg:
    return FedAvg(RunConfig.from_mapping(CENTRAL | values), None, SHAPE, num_seen)


def nodes(count: int) -> list[NodeInfo]:
    return [NodeInfo(i, f"n{i}", True, 10, 5, SHAPE) for i in range(count)]


def test_a_central_dp_sample_is_poisson_from_the_os_and_not_the_runs_seed():
    """On 4c70931 both strategies drew the same 20 of 40 from default_rng([seed, round])."""
    seen = nodes(40)
    first, second = server(40, **{"fraction-train": 0.5}), server(40, **{"fraction-train": 0.5})
    draws = [first.sample(seen, 1), second.sample(seen, 1)]
    assert draws[0] != draws[1]  # the same seed and round, other nodes (equal: 1 in 10^12)
    sizes = {len(first.sample(seen, r)) for r in range(2, 12)}
    assert len(sizes) > 1  # each node independently at q = 0.5: the count varies, not fixed at 20
    assert first.samples_privately(40) and not server(40).samples_privately(40)  # every node: nothing to hide
    plain = [FedAvg(RunConfig.from_mapping({"fraction-train": 0.5}), None, SHAPE, 40).sample(seen, 1) for _ in "ab"]
    assert plain[0] == plain[1] and len(plain[0]) == 20  # without dp, a run repeats


def test_results_keep_how_many_failed_in_a_private_round_not_who():
    cfg = RunConfig.from_mapping(CENTRAL | {"fraction-train": 0.5, "num-server-rounds": 2})
    results = results_module.Results(cfg)
    results.failures = [
        {"round": r, "node_id": 7, "node": "node 7 (n7)", "message_type": "train", "reason": "timed out"}
        for r in (0, 1, 3)
    ]
    rows = results.to_json()["failures"]
    assert [f["node"] for f in rows] == ["node 7 (n7)", results_module.WITHHELD, "node 7 (n7)"]
    assert "node_id" not in rows[1] and rows[1]["reason"] == "timed out"


def test_two_runs_at_one_seed_train_other_nodes_and_results_name_none(tmp_path, monkeypatch):
    """A real in-process run: who trained each round, as the server half was handed them."""
    trained: list[list[str]] = []
    original = FedAvg.train_round

    def spy(self, server_round, chosen):
        trained.append(sorted(n.key for n in chosen))
        return original(self, server_round, chosen)

    monkeypatch.setattr(FedAvg, "train_round", spy)
    values = CENTRAL | {"fraction-train": 0.5, "num-server-rounds": 3, "min-nodes": 8, "min-train-nodes": 1}
    runs = []
    for name in ("a", "b"):
        cfg = RunConfig.from_mapping(values | {"results-dir": str(tmp_path / name), "eval-every": 0})
        runs.append(run_in_process(cfg, 8))
    assert trained[:3] != trained[3:]  # same seed, other samples (equal: about 1 in 2^24)
    for results in runs:
        rounds = json.dumps(results["rounds"]) + json.dumps(results["failures"])
        keys = [c["client"] for c in results["clients"]]
        assert results["complete"] and not [k for k in keys if f'"{k}"' in rounds]
        assert all(r["dp_relation"] == "add/remove" and r["dp_epsilon"] > 0 for r in results["rounds"])


def test_a_resume_with_more_nodes_adds_its_rounds_to_what_was_spent():
    """4 nodes, q = 0.5 (min-train-nodes 2 of 4) for two rounds, then 8 (q = 0.25): ε is the sum of
    both parts; on 4c70931 the resumed run reported three rounds at 0.25, less than was spent."""
    values = {"fraction-train": 0.25, "min-train-nodes": 2}
    before = server(4, **values)
    before.aggregate([])
    before.aggregate([])
    after = server(8, **values)
    after.load_state(before.state())
    after.aggregate([])
    owed = privacy.tightest(((0.5, 1.0), (0.5, 1.0), (0.25, 1.0)), 1e-5)[0]
    reported = after.round_extras()["dp_epsilon"]
    assert reported >= owed * (1 - 1e-9) and reported > privacy.tightest(((0.25, 1.0),) * 3, 1e-5)[0]
    assert [r[2] for r in after.state()["dp_ledger"]] == [4.0, 4.0, 8.0]  # counts of nodes, never who


def test_a_resume_that_cannot_add_up_what_was_spent_is_refused_in_one_line():
    earlier = server(4).state()
    with pytest.raises(ValueError, match=r"^cannot resume: the checkpoint counts 2 noised rounds but keeps no") as err:
        server(4).load_state({"model": earlier["model"], "private_rounds": 2})
    assert "\n" not in str(err.value)
    other = earlier | {"dp_ledger": [[1.0, 1.0, 4.0, 0.0]], "dp_assumptions": {"mode": "local"}}
    with pytest.raises(ValueError, match="^cannot resume: the privacy accounting would change"):
        server(4).load_state(other)


def test_pld_stands_beside_rdp_and_the_tighter_calibrates_and_reports():
    """PLD against an independent implementation (Opacus's PRV accountant) within 1 %; the plan
    takes the smaller σ; a row says which accountant bounded its ε."""
    from opacus.accountants.utils import get_noise_multiplier

    pld = privacy.noise_multiplier(3.0, 1e-5, 1.0, 30, "pld")
    prv = get_noise_multiplier(
        target_epsilon=3, target_delta=1e-5, sample_rate=1.0, steps=30, accountant="prv", epsilon_tolerance=0.001
    )
    assert pld == pytest.approx(prv, rel=0.01) and pld < 0.95 * privacy.noise_multiplier(3.0, 1e-5, 1.0, 30)
    plan = privacy.Plan.of(RunConfig.from_mapping(CENTRAL | {"dp-noise-multiplier": 0.0, "dp-epsilon": 3.0}))
    assert plan.sigma == pytest.approx(pld) and plan.accountant == "pld"
    row = plan.row(30)
    assert row["dp_accountant"] == "pld" and row["dp_epsilon"] == pytest.approx(3.0, rel=1e-3)


def test_local_dp_may_promise_replace_one_at_twice_the_noise():
    values = {"dp": "local", "dp-noise-multiplier": 1.5, "dp-clip": 0.2, "dp-relation": "replace-one"}
    plan = privacy.Plan.of(RunConfig.from_mapping(values))
    assert plan.relation == "replace-one" and plan.sensitivity == pytest.approx(0.4)
    start = {"w": torch.zeros(200_000)}
    sent = privacy.local_update(start, start, plan, privacy.noise_generator(1))
    assert sent["w"].double().std().item() == pytest.approx(1.5 * 0.4, rel=0.02)
    assert privacy.Plan.of(RunConfig.from_mapping(values | {"dp-relation": "zero-out"})).relation == "zero-out"


def test_replace_one_outside_local_dp_is_one_line(refuses_in_one_line):
    refuses_in_one_line(
        ["--run-config", 'dp="central" dp-epsilon=3 dp-relation="replace-one"'], 'replace-one under dp = "local" only'
    )


def test_a_clipped_noise_share_goes_into_delta():
    plan = privacy.Plan("distributed", 1.0, 8.0, 1e-5, math.inf, 1.0, relation="zero-out")
    ledger = Ledger(plan, 4)
    ledger.record(0.0)
    assert "dp_delta" not in ledger.row()
    ledger.record(1e-3)
    row = ledger.row()
    assert row["dp_delta"] == pytest.approx(1e-5 + (1 + math.exp(row["dp_epsilon"])) * 1e-3)


def test_a_secure_round_that_draws_too_few_to_mask_releases_its_noise_alone():
    """A Poisson draw of one node under secure aggregation: nobody is asked (one masked vector
    would be that node's update), the model moves by N(0, σ²C²)/m alone and the round is
    accounted; on 4c70931 the round stopped the run ("needs at least 2 nodes")."""
    values = {"fraction-train": 0.5, "secure-aggregation": "secaggplus", "dp-noise-multiplier": 2.0, "dp-clip": 0.5}
    fedavg = server(4, **values)
    start = {k: t.clone() for k, t in fedavg.model.state_dict().items()}
    assert fedavg.train_round(1, nodes(1)) is None  # exchanger None: any exchange would raise
    delta = privacy.update(fedavg.model.state_dict(), start)
    flat = torch.cat([torch.from_numpy(d).reshape(-1) for d in delta.values()])
    assert flat.std().item() == pytest.approx(2.0 * 0.5 / 2, rel=0.03) and fedavg.private_rounds == 1
