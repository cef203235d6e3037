"""Robust aggregation (florist/server/aggregation.py) against one or two malicious nodes of five.

In-process federations on the embedded digits (iid, 5 training nodes, 15 rounds, the default
CNN): partition 0 rewrites its own training replies with `client_mods.attack`, the client mod
benchmarks/robustness.py uses too. It scales its update ×1000 relative to the model it
received, flips its sign, or flips it and claims 10¹² examples (in its replies only, or at
discovery too); with partition 1 sending NaN beside its ×1000 (`colluders`); or it returns the
model it received, claiming 10¹² examples (`stall`; `noop2`: partitions 0 and 1, honest
counts). Plain `mean` is shown to be hurt where the attack
is strong, so the defences are tested against something real; each rule is also checked on
hand-made tensors, and against Flower's own functions fed float64."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Message

from florist.apps.client import build_client_app
from florist.apps.server import server_half
from florist.common import client_mods, protocol
from florist.config import RunConfig, parse_aggregation
from florist.runners.inprocess import run_in_process
from florist.server import aggregation
from florist.server.aggregation import Aggregator, clip_updates, node_weight, weighted_average
from florist.server.strategy import mean_loss
from florist.strategies.fedavg.server import FedAvg

MALICIOUS = 100  # node id of partition 0 in the in-process grid
FIVE = {
    "num-server-rounds": 15,
    "partition": "iid",
    "unseen-fraction": 0.0,  # all five train: Krum with f = 1 needs n > 4
    "min-nodes": 5,
    "eval-every": 0,
    "seed": 1,
}


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """`federation(attack, **settings)`: the results of a five-node run (cached per module)."""
    cache: dict[tuple, dict] = {}

    def run(attack: str = "", **settings) -> dict:
        key = (attack, tuple(sorted(settings.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp("adversarial")
            cfg = RunConfig.from_mapping(FIVE | settings | {"results-dir": str(folder)})
            app = build_client_app([client_mods.attack(attack)]) if attack else None
            cache[key] = run_in_process(cfg, 5, client_app=app)
        return cache[key]

    return run


def accuracy(results: dict) -> float:
    """The final mean accuracy of the seen clients, in points."""
    return 100 * results["summary"]["seen"]["mean_accuracy"]


def blamed_honest_nodes(results: dict, attackers: int = 1) -> set[int]:
    return {f["node_id"] for f in results["failures"]} - set(range(MALICIOUS, MALICIOUS + attackers))


# -- the attacks are real -----------------------------------------------------------------


@pytest.mark.parametrize("attack", ["scale", "claim-info"])
def test_plain_mean_is_ruined_by_one_node(federation, attack):
    honest = accuracy(federation())
    assert honest > 90
    assert accuracy(federation(attack)) < 30  # chance is 10


# -- the defences -------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["median", "trimmed:0.2", "krum:1"])
@pytest.mark.parametrize("attack", ["scale", "flip", "claim-info"])
def test_a_robust_rule_keeps_accuracy_within_5_points_of_the_honest_run(federation, attack, rule):
    attacked = federation(attack, aggregation=rule)
    assert accuracy(attacked) >= accuracy(federation()) - 5, (attack, rule)
    assert not blamed_honest_nodes(attacked)


def test_clipping_bounds_the_scaled_attack_under_the_mean(federation):
    """Honest updates here are 0.3-2 in L2 from the global model; clipped to 2, the ×1000
    update counts for no more than an honest one."""
    clipped = federation("scale", **{"clip-norm": 2.0})
    assert accuracy(clipped) >= accuracy(federation()) - 5
    assert accuracy(clipped) > accuracy(federation("scale")) + 50
    assert not blamed_honest_nodes(clipped)
    assert all("partition-0" in row["clipped"] for row in clipped["rounds"])  # it was clipped every round
    assert not any({"partition-1", "partition-2"} & set(row["clipped"]) for row in clipped["rounds"])


def test_the_discovery_cap_makes_a_huge_claim_worth_an_honest_one(federation):
    """A node that claims 10¹² examples in its replies weighs what it reported at discovery,
    which is what it would have claimed honestly: the run is the plain sign-flip run, bit for bit."""
    claimed, flipped = federation("claim"), federation("flip")
    assert [c["accuracy"] for c in claimed["clients"]] == [c["accuracy"] for c in flipped["clients"]]
    assert accuracy(claimed) > accuracy(federation("claim-info")) + 50


def test_max_node_examples_bounds_a_node_that_lies_at_discovery_too(federation):
    """Honest nodes hold 207-208 training examples; a cap of 250 makes the liar one of five."""
    capped = federation("claim-info", **{"max-node-examples": 250})
    assert accuracy(capped) >= accuracy(federation()) - 10
    assert accuracy(capped) > accuracy(federation("claim-info")) + 50
    assert not blamed_honest_nodes(capped)


@pytest.mark.parametrize(
    ("attack", "rule", "used", "left_out"),
    [
        ("colluders", "trimmed:0.2", "median", []),  # ⌊0.2·4⌋ = 0: the plain mean before
        ("stall", "multikrum:1", "median", ["partition-0"]),  # its 10¹² weight ruled the mean of the kept
        ("noop2", "krum:1", "median", ["partition-0", "partition-1"]),  # two no-op copies: picked every round
    ],
)
def test_two_colluders_or_nodes_that_do_not_train_cannot_degrade_a_robust_rule(
    federation, attack, rule, used, left_out
):
    """Each round the rule cannot hold as named (4 or 3 replies left) is the median, recorded
    with the reason; the nodes that sent the model back are left out, named, and no other."""
    attacked = federation(attack, aggregation=rule)
    assert accuracy(attacked) >= accuracy(federation()) - 5
    assert not blamed_honest_nodes(attacked, attackers=2)
    for row in attacked["rounds"]:
        assert row["aggregation"] == used and row["left_out"] == left_out, row
        assert "the median this round" in row["aggregation_note"], row


def test_krum_leaves_the_scaling_node_out_and_says_so(federation):
    results = federation("scale", aggregation="krum:1")
    assert all(row["aggregation"] == "krum" and "partition-0" in row["left_out"] for row in results["rounds"])
    assert all(len(row["left_out"]) == 4 for row in results["rounds"])  # Krum keeps one model


def test_fedattns_shared_model_and_the_biases_it_attends_over_resist_the_scaled_attack(federation):
    honest = accuracy(federation(strategy="fedattn"))
    assert accuracy(federation("scale", strategy="fedattn")) < 30
    robust = federation("scale", strategy="fedattn", aggregation="median")
    assert accuracy(robust) >= honest - 5
    assert not blamed_honest_nodes(robust)


# -- `mean` is today's FedAvg, bit for bit ------------------------------------------------


def fedavg_before(states, weights):
    """FedAvg's aggregation as it was before robust aggregation existed (a frozen copy)."""
    total = float(sum(weights))
    heaviest = states[max(range(len(weights)), key=weights.__getitem__)]
    return {
        key: (
            sum(s[key].double() * (w / total) for s, w in zip(states, weights)).to(ref.dtype)
            if ref.is_floating_point()
            else heaviest[key].clone()
        )
        for key, ref in states[0].items()
    }


def test_mean_is_the_fedavg_of_before_bit_for_bit(tmp_path, monkeypatch):
    def aggregate_before(self, done):
        if done:
            self.model.load_state_dict(
                fedavg_before([r.arrays for _, r in done], [r.metrics["num-examples"] for _, r in done])
            )
        return mean_loss(r.metrics for _, r in done)

    def run(name: str, **settings) -> tuple[dict, dict]:
        values = {"num-server-rounds": 3, "partition": "dirichlet:0.5", "min-nodes": 5, "eval-every": 0}
        cfg = RunConfig.from_mapping(values | settings | {"results-dir": str(tmp_path / name)})
        results = run_in_process(cfg, 5)
        return results, torch.load(tmp_path / name / "checkpoint.pt")["state"]["model"]

    now, now_model = run("now")  # aggregation, clip-norm and max-node-examples unset
    explicit, explicit_model = run("explicit", aggregation="mean", **{"clip-norm": 0.0, "max-node-examples": 0})
    monkeypatch.setattr(FedAvg, "aggregate", aggregate_before)
    before, before_model = run("before")
    assert len({c["num_train"] for c in before["clients"]}) > 1  # unequal weights: they matter
    for results, model in ((now, now_model), (explicit, explicit_model)):
        assert all(torch.equal(model[k], before_model[k]) for k in before_model)
        assert [r["train_loss"] for r in results["rounds"]] == [r["train_loss"] for r in before["rounds"]]
        assert results["clients"] == before["clients"]
        assert "aggregation" not in results["rounds"][-1]  # nothing new in the results either


def test_mean_is_the_hand_computed_weighted_mean_and_the_old_function_bit_for_bit():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(5)}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(9)}
    out = Aggregator()([a, b], [1, 3])
    assert torch.equal(out.state["w"], torch.tensor([2.5, 5.0])) and out.state["n"].item() == 9
    states = [{"w": torch.randn(7, 3, generator=torch.Generator().manual_seed(i))} for i in range(5)]
    weights = [3, 1, 4, 1, 5]
    assert torch.equal(Aggregator()(states, weights).state["w"], fedavg_before(states, weights)["w"])
    assert torch.equal(weighted_average(states, weights)["w"], fedavg_before(states, weights)["w"])


# -- each rule on hand-made tensors --------------------------------------------------------


def states_of(*rows) -> list[dict[str, torch.Tensor]]:
    """One state per row: a float tensor `w` and an integer counter `n` (its index)."""
    return [{"w": torch.tensor(row, dtype=torch.float32), "n": torch.tensor(i)} for i, row in enumerate(rows)]


def test_median_is_the_middle_value_or_the_mean_of_the_two_middle_ones():
    odd = Aggregator("median")(states_of([1.0, -7.0], [5.0, 0.0], [2.0, 3.0], [100.0, 1.0], [-7.0, 2.0]), [1] * 5)
    assert torch.equal(odd.state["w"], torch.tensor([2.0, 1.0]))
    even = Aggregator("median")(states_of([1.0], [5.0], [2.0], [100.0]), [1, 1, 7, 3])
    assert torch.equal(even.state["w"], torch.tensor([3.5]))  # (2 + 5) / 2; torch.median would say 2
    assert even.state["n"].item() == 2  # integer buffers from the heaviest node, weights capped at the median (2)


def test_trimmed_mean_drops_floor_beta_n_values_at_each_end():
    rows = ([1.0, 10.0], [2.0, 20.0], [6.0, -1000.0], [1e6, 30.0], [-1e6, 40.0])
    out = Aggregator("trimmed:0.2")(states_of(*rows), [1] * 5)  # ⌊0.2·5⌋ = 1 at each end
    assert torch.equal(out.state["w"], torch.tensor([3.0, 20.0]))  # (1+2+6)/3, (10+20+30)/3
    assert torch.equal(
        Aggregator("trimmed:0.0")(states_of([1.0], [2.0], [6.0]), [9, 1, 1]).state["w"], torch.tensor([3.0])
    )


# Four models near the origin and one far: squared distances a-b 1, a-c 4, a-d 2, b-c 5, b-d 1,
# c-d 2. With f = 1 each model's score sums its n − f − 2 = 2 nearest: a 1+2, b 1+1, c 2+4,
# d 1+2, e 162+164; Krum picks b, Multi-Krum the m = 4 best: a, b, c, d.
POINTS = ([0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [1.0, 1.0], [10.0, 10.0])


def test_krum_picks_the_model_with_the_smallest_score():
    distances = aggregation.pairwise_distances(states_of(*POINTS))
    exact = dict(rtol=1e-14, atol=0)  # float64 from the differences: a square root squared is all
    torch.testing.assert_close(distances[0], torch.tensor([0.0, 1.0, 4.0, 2.0, 200.0], dtype=torch.float64), **exact)
    scores = aggregation.krum_scores(distances, 1)
    torch.testing.assert_close(scores, torch.tensor([3.0, 2.0, 6.0, 3.0, 326.0], dtype=torch.float64), **exact)
    out = Aggregator("krum:1")(states_of(*POINTS), [1, 1, 1, 1, 10**6])
    assert torch.equal(out.state["w"], torch.tensor([1.0, 0.0])) and out.kept == [1] and out.rule == "krum"
    assert out.state["n"].item() == 1  # the picked model's counters, whatever the others weigh


def test_multikrum_averages_the_n_minus_f_best_by_their_weights_capped_at_the_median():
    out = Aggregator("multikrum:1")(states_of(*POINTS), [1, 2, 1, 4, 10**6])  # capped at 2: 1, 2, 1, 2
    assert out.kept == [0, 1, 2, 3]
    assert torch.equal(out.state["w"], torch.tensor([4 / 6, 4 / 6]))  # (2·b + 2·d + c) / 6
    assert out.state["n"].item() == 1  # the heaviest model kept, the first of two
    assert torch.equal(Aggregator("multikrum:0")(states_of(*POINTS), [1] * 5).state["w"], torch.tensor([2.4, 2.6]))


def test_krum_with_too_few_replies_falls_back_to_the_median_with_one_warning(caplog):
    caplog.set_level(logging.WARNING, logger="flwr")
    out = Aggregator("krum:1")(states_of([0.0], [1.0], [5.0], [100.0]), [1] * 4)  # needs n > 4
    assert out.rule == "median" and torch.equal(out.state["w"], torch.tensor([3.0]))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["aggregation krum:1: needs more than 4 distinct replies, got 4: the median this round"]
    assert out.note == warnings[0].removeprefix("aggregation krum:1: ")


def test_clipping_pulls_far_updates_onto_the_sphere_and_leaves_the_others_alone():
    reference = {"w": torch.tensor([1.0, 1.0]), "n": torch.tensor(0)}
    near, far = states_of([1.5, 1.0], [4.0, 5.0])  # updates (0.5, 0) and (3, 4), of norm 5
    clipped, which = clip_updates([near, far], reference, 2.5)
    assert which == [1] and clipped[0] is near
    assert torch.equal(clipped[1]["w"], torch.tensor([2.5, 3.0])) and clipped[1]["n"] is far["n"]
    out = Aggregator("mean", clip_norm=2.5)([near, far], [1, 1], reference)
    assert torch.equal(out.state["w"], torch.tensor([2.0, 2.0])) and out.clipped == [1]


def test_a_nodes_weight_is_capped_by_its_discovery_count_and_max_node_examples():
    assert node_weight(10**12, 208) == 208
    assert node_weight(100, 208) == 100
    assert node_weight(10**12, 10**12, cap=250) == 250
    assert Aggregator(max_node_examples=50).weight(100, 208) == 50
    zero = Aggregator()(states_of([1.0], [3.0]), [0, 0])  # all claim nothing: equal weights, not NaN
    assert torch.equal(zero.state["w"], torch.tensor([2.0]))


@pytest.mark.parametrize("spec", ["trimmed:0.5", "trimmed:-0.1", "trimmed:x", "krum:-1", "krum:1.5", "mean:1", "avg"])
def test_an_unknown_rule_fails_at_start_up_in_one_line(spec):
    with pytest.raises(ValueError, match=r"^invalid run config: aggregation must be mean \| median") as err:
        RunConfig.from_mapping({"aggregation": spec})
    assert "\n" not in str(err.value)


def test_the_rules_and_bounds_parse():
    assert parse_aggregation("trimmed:0.25") == ("trimmed", 0.25) and parse_aggregation("krum:2") == ("krum", 2.0)
    assert RunConfig.from_mapping({"aggregation": "multikrum:0"}).aggregation == "multikrum:0"
    with pytest.raises(ValueError, match="clip-norm must be"):
        RunConfig.from_mapping({"clip-norm": -1.0})
    with pytest.raises(ValueError, match="max-node-examples must be"):
        RunConfig.from_mapping({"max-node-examples": -1})


def test_the_rules_agree_with_flowers_own_functions_in_float64():
    """Flower's (legacy, unexported) numpy functions as an oracle: median, trimmed mean, Krum's
    pick and Multi-Krum's weighted mean (Flower fed the weights capped at their median, 3), on
    random models of two layers."""
    from flwr.server.strategy import aggregate as flower

    gen = torch.Generator().manual_seed(0)
    states = [{"a": torch.randn(4, 3, generator=gen), "b": torch.randn(5, generator=gen)} for _ in range(7)]
    weights = [3, 1, 4, 1, 5, 9, 2]
    capped = [min(w, 3) for w in weights]
    layers = [([s["a"].double().numpy(), s["b"].double().numpy()], w) for s, w in zip(states, capped)]
    expected = {
        "median": flower.aggregate_median(layers),
        "trimmed:0.3": flower.aggregate_trimmed_avg(layers, 0.3),
        "krum:2": flower.aggregate_krum(layers, 2, 0),
        "multikrum:2": flower.aggregate_krum(layers, 2, 5),
    }
    for spec, (a, b) in expected.items():
        got = Aggregator(spec)(states, weights).state
        np.testing.assert_allclose(got["a"].numpy(), a.astype(np.float32), rtol=1e-6, err_msg=spec)
        np.testing.assert_allclose(got["b"].numpy(), b.astype(np.float32), rtol=1e-6, err_msg=spec)


# -- PeFLL: the rule over the clients' Δη --------------------------------------------------


def scaled_delta(msg: Message, context: Context, call_next):
    """A mod: partition 0 sends its Δθ ×1000."""
    reply = call_next(msg, context)
    if msg.metadata.message_type == "train.generated" and context.node_config["partition-id"] == 0:
        delta = reply.content.array_records[protocol.ARRAYS].to_torch_state_dict()
        reply.content.array_records[protocol.ARRAYS] = ArrayRecord({k: 1000 * v for k, v in delta.items()})
    return reply


def test_pefll_combines_the_clients_pseudo_gradients_by_the_rule(tmp_path):
    """One round, plain SGD on the server: the per-client path with `mean` (made non-plain by
    an unreachable clip-norm) moves the networks as the one backward pass does; a node sending
    Δθ ×1000 throws the mean's step far off and the median's no further than honest steps go."""

    def networks(name: str, app=None, **settings) -> dict[str, torch.Tensor]:
        values = FIVE | {"strategy": "pefll", "num-server-rounds": 1, "hn-local-steps": 5, "hn-optimizer": "sgd"}
        values |= {"hn-server-lr": 0.1, "results-dir": str(tmp_path / name)} | settings
        run_in_process(RunConfig.from_mapping(values), 5, client_app=app)
        state = torch.load(tmp_path / name / "checkpoint.pt")["state"]
        return {f"{net}.{k}": v for net in ("hyper", "embed") for k, v in state[net].items()}

    start = server_half("pefll")(RunConfig.from_mapping(FIVE | {"strategy": "pefll"}), None, (1, 8, 8), 5)
    before = {f"{net}.{k}": v for net in ("hyper", "embed") for k, v in getattr(start, net).state_dict().items()}
    step = lambda after: float(sum(((after[k] - before[k]).double() ** 2).sum() for k in before).sqrt())  # noqa: E731
    plain = networks("plain")
    per_client = networks("per-client", **{"clip-norm": 1e9})
    for key in plain:
        torch.testing.assert_close(per_client[key], plain[key], atol=1e-7, rtol=1e-5, msg=key)
    attacked = step(networks("mean", build_client_app([scaled_delta])))
    robust = step(networks("median", build_client_app([scaled_delta]), aggregation="median"))
    assert attacked > 100 * step(plain)
    assert robust < 2 * step(plain)
