"""`dp` on FedAvg's family (docs/privacy.md): off, aggregation is what it always was, bit for bit;
central, the server's noised mean has the std it claims; local, a node's update leaves it
clipped and noised; a run stops before the round that would overspend a capped budget; a real
run reports ε per round; every combination dp does not cover is one line, exit 2, before the run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from florist.cli import main
from florist.common import privacy, protocol
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.server.aggregation import weighted_average
from florist.server.strategy import NodeInfo, Reply
from florist.strategies.fedavg import client as fedavg_client
from florist.strategies.fedavg.server import FedAvg

SHAPE = (1, 8, 8)


def server(num_seen: int = 4, **values) -> FedAvg:
    return FedAvg(RunConfig.from_mapping({"strategy": "fedavg"} | values), None, SHAPE, num_seen)


def replies(model: torch.nn.Module, count: int, scale: float = 0.1) -> list[tuple[NodeInfo, Reply]]:
    """`count` nodes' trained models: the global one moved by seeded noise of std `scale`."""
    generator = torch.Generator().manual_seed(0)
    done = []
    for i in range(count):
        state = {
            k: t + scale * torch.randn(t.shape, generator=generator) if t.is_floating_point() else t + i
            for k, t in model.state_dict().items()
        }
        done.append(
            (NodeInfo(i, f"n{i}", True, 10 + i, 5, SHAPE), Reply({"num-examples": 10 + i, "train-loss": 1.0}, state))
        )
    return done


def test_dp_none_aggregates_bit_for_bit_as_before():
    fedavg = server()
    done = replies(fedavg.model, 3)
    expected = weighted_average([r.arrays for _, r in done], [10, 11, 12])
    fedavg.aggregate(done)
    got = fedavg.model.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert fedavg.round_extras() == {} and fedavg.state().keys() == {"model"}
    assert fedavg.stop_before(10**6) == ""


def test_central_dp_adds_noise_of_std_sigma_c_over_the_sampled_count_to_the_mean():
    """Replies equal to the model sent: the new model minus the old is the noise alone, σ·C/m
    with m = 3 of 4 nodes sampled (fraction-train 0.75), whatever the 2 that replied."""
    values = {"dp": "central", "dp-noise-multiplier": 2.0, "dp-clip": 0.5, "fraction-train": 0.75, "dp-noise-seed": 7}
    fedavg = server(**values)
    start = {k: t.clone() for k, t in fedavg.model.state_dict().items()}
    fedavg.aggregate([(n, Reply(r.metrics, start)) for n, r in replies(fedavg.model, 2)])
    delta = privacy.update(fedavg.model.state_dict(), start)
    flat = torch.cat([torch.from_numpy(d).reshape(-1) for d in delta.values()])
    assert flat.numel() > 50_000 and flat.std().item() == pytest.approx(2.0 * 0.5 / 3, rel=0.03)
    row = fedavg.round_extras()
    assert row["dp_clipped"] == 0 and row["dp_noise_multiplier"] == 2.0
    assert row["dp_epsilon"] is None and row["dp_guarantee"] == privacy.UNSEEDED  # seeded noise promises nothing
    assert fedavg.ledger.history() == ((0.75, 2.0),) and fedavg.state()["private_rounds"] == 1


def test_a_local_dp_node_sends_its_update_clipped_and_noised(make_node):
    values = {"dp": "local", "dp-noise-multiplier": 1.5, "dp-clip": 0.2, "dp-noise-seed": 3}
    node = make_node(values)
    model = node.new_model()
    config = RunConfig.from_mapping(values).to_mapping(travelling=True)
    request = fedavg_client.Request(None, protocol.content(protocol.to_record(model), config))
    sent = protocol.arrays_of(fedavg_client.train(node, request), model.state_dict(), "test")
    delta = privacy.update(sent, model.state_dict())
    flat = torch.cat([torch.from_numpy(d).reshape(-1) for d in delta.values()])
    # the clipped update (norm 0.2) is lost in the noise: std σ·C per coordinate
    assert flat.std().item() == pytest.approx(1.5 * 0.2, rel=0.03)


def test_a_capped_budget_stops_training_before_the_round_that_would_exceed_it(tmp_path, caplog):
    """σ = 1 given with a cap between ε after one round and after two: one round trains, the run
    is still evaluated and complete, and says why it stopped."""
    spend = lambda rounds: privacy.tightest(((1.0, 1.0),) * rounds, 1e-5)[0]  # noqa: E731
    cap = (spend(1) + spend(2)) / 2
    values = {
        "dp": "central",
        "dp-noise-multiplier": 1.0,
        "dp-epsilon": cap,
        "dp-clip": 0.05,
        "num-server-rounds": 3,
        "min-nodes": 4,
        "dp-noise-seed": 1,
        "results-dir": str(tmp_path / "run"),
    }
    results = run_in_process(RunConfig.from_mapping(values), 4)
    assert results["complete"] and [r["round"] for r in results["rounds"]] == [1]
    assert results["rounds"][0]["dp_guarantee"] == privacy.UNSEEDED  # the cap still counts what it would spend
    assert results["stopped"].startswith("dp: round 2 would spend ε = ")
    assert results["stopped"] in caplog.text
    report = (tmp_path / "run" / "report.md").read_text()
    assert f"Training stopped early: {results['stopped']}." in report and "Differential privacy `central`" in report


def test_a_central_dp_simulation_reports_epsilon_per_round_within_its_budget(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["simulate", "--runtime", "in-process", "--strategy", "fedavg", "--num-clients", "4", "--rounds", "2"]
    args += ["--run-config", 'dp="central" dp-epsilon=3 dp-clip=1.0', "--results-dir", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    spent = [r["dp_epsilon"] for r in results["rounds"]]
    assert results["complete"] and len(spent) == 2 and spent[0] < spent[1] <= 3
    assert spent[1] == pytest.approx(3, rel=1e-3)  # σ calibrated to spend the budget over the run
    printed = " ".join(capsys.readouterr().err.split())  # the console's, wrapped to its width
    accountant = results["rounds"][1]["dp_accountant"].upper()
    assert f"ε = {spent[1]:.3g} spent (δ = 1e-05, {accountant}, add/remove neighbours) after 2 rounds" in printed


REFUSED = {
    "uncovered strategy": (["--strategy", "pefll", "--run-config", 'dp="central" dp-epsilon=3'], "no differential"),
    "robust rule": (['dp="local" dp-epsilon=3 aggregation="median"'], 'needs aggregation = "mean"'),
    "no budget": (['dp="central"'], "needs dp-epsilon (the budget) or dp-noise-multiplier"),
    "budget without dp": (["dp-epsilon=3"], 'but dp = "none": fedavg would noise nothing'),
    "unknown mode": (['dp="global"'], "dp must be one of none, central, local, distributed"),
    "distributed in the clear": (['dp="distributed" dp-epsilon=3'], 'needs secure-aggregation = "secaggplus"'),
    "clip without dp": (["dp-clip=0.5"], 'act only with dp other than "none"'),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_what_dp_does_not_cover_is_one_line_and_exit_2_before_the_run(case, refuses_in_one_line):
    args, expected = REFUSED[case]
    refuses_in_one_line(args if args[0] == "--strategy" else ["--run-config", *args], expected)


def test_a_budget_that_stops_a_run_before_its_first_round_is_still_said():
    from florist.server.report import privacy_lines

    stop = "dp: round 1 would spend ε = 9 > dp-epsilon 1"
    assert privacy_lines({"rounds": [], "config": {}, "stopped": stop}) == [f"Training stopped early: {stop}.", ""]


def test_a_nodes_own_local_dp_is_not_the_servers_to_turn_off_or_weaken():
    from florist.client.guard import Refused
    from florist.client.node import _run_config

    own = {"dp": "local", "dp-epsilon": 3.0}  # a box that does not trust its server
    assert _run_config({"dp": "none"}, own, "box").dp == "local"  # the server cannot turn it off
    server = {"dp": "local", "dp-epsilon": 50.0, "dp-noise-multiplier": 1e-4, "dp-noise-seed": 7}
    weaker = _run_config(server, own, "box")  # nor weaken it (ε, σ), nor pick noise it knows
    assert (weaker.dp_epsilon, weaker.dp_noise_multiplier, weaker.dp_noise_seed) == (3.0, 0.0, 0)
    trusting = _run_config(server, {"trusted-server": True}, "p-0")  # a simulation's nodes take the server's
    assert (trusting.dp_epsilon, trusting.dp_noise_seed) == (50.0, 7)
    secure = {"secure-aggregation": "secaggplus", "dp": "central", "dp-epsilon": 3.0}
    with pytest.raises(Refused, match="its own dp differ from the server's under secure aggregation"):
        _run_config(secure, own, "box")
    assert _run_config(secure, {"dp": "central", "dp-epsilon": 3.0}, "box").dp == "central"  # the same: fine


def test_a_local_dp_node_repeats_its_stored_draw_and_stops_at_its_own_lifetime_budget(make_node):
    """A repeated round gets the noise drawn the first time (fresh draws would average it away),
    and a node whose own budget holds one release refuses the next, whatever the server's rounds."""
    from florist.client.ledger import Ledger
    from florist.strategies.fedavg.client import local_dp

    own = {"dp": "local", "dp-epsilon": 3.0}
    node = make_node(own | {"num-server-rounds": 100}, node_config=own | {"dp-releases": 1}, server_round=1)
    start = node.new_model().state_dict()
    first, again = (local_dp(node, Ledger(node), start, start) for _ in range(2))
    assert all(np.array_equal(first[k], again[k]) for k in first) and Ledger(node).prior() is not None
    node.server_round = 2
    with pytest.raises(ValueError, match=r"spend ε = .* > its dp-epsilon 3 \(1 releases in its lifetime"):
        Ledger(node).prior()


@pytest.mark.parametrize("mode", ["central", "local"])
def test_under_dp_a_node_whose_weights_blow_past_what_a_server_takes_sends_no_change(make_node, monkeypatch, mode):
    """A finite but diverged model (a weight of 1e10, which a server refuses beyond ±1e9) is zeroed
    like a nan loss: the node sends the model it received (under local, noised), and says so but
    under local, where neither that flag nor its train loss leaves the node un-noised."""
    values = {"dp": mode, "dp-noise-multiplier": 1.0}
    node = make_node(values)
    model = node.new_model()

    def blown(self, trained, epochs, **options):
        with torch.no_grad():
            next(trained.parameters()).fill_(1e10)
        return 0.5

    monkeypatch.setattr(type(node), "fit", blown)
    config = RunConfig.from_mapping(values).to_mapping(travelling=True)
    request = fedavg_client.Request(None, protocol.content(protocol.to_record(model), config))
    reply = fedavg_client.train(node, request)
    sent = protocol.arrays_of(reply, model.state_dict(), "test")
    metrics = reply.metric_records[protocol.METRICS]
    if mode == "local":
        assert set(metrics) == {"num-examples"} and privacy.norm(privacy.update(sent, model.state_dict())) > 1
        return
    assert all(torch.equal(sent[k], t) for k, t in model.state_dict().items())
    assert metrics["dp-zeroed"] == 1
