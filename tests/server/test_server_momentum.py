"""Server momentum (FedAvgM) on FedAvg's family: off (β 0, η 1) a round is plain FedAvg bit for bit;
on, two rounds land where the closed form says; the velocity survives a resume; a value out of range,
or a strategy that takes no server step, is refused in one line, exit 2."""

from __future__ import annotations

import pytest
import torch

from florist.config import RunConfig
from florist.server.aggregation import weighted_average
from florist.server.strategy import NodeInfo, Reply
from florist.strategies.fedavg.server import FedAvg

SHAPE = (1, 8, 8)
NODES = [NodeInfo(i, f"n{i}", True, 10 + i, 5, SHAPE) for i in range(3)]


def server(**values) -> FedAvg:
    fedavg = FedAvg(RunConfig.from_mapping({"strategy": "fedavg"} | values), None, SHAPE, len(NODES))
    fedavg.request = lambda *args, **kwargs: None  # no network: the replies come from `offsets`
    return fedavg


def offsets(seed: int) -> list[dict[str, torch.Tensor]]:
    """Each node's change to the model it is sent, seeded: the same for every server."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {k: t.shape for k, t in server().model.state_dict().items() if t.is_floating_point()}
    return [{k: 0.1 * torch.randn(s, generator=generator) for k, s in shapes.items()} for _ in NODES]


def train(fedavg: FedAvg, changes: list[dict[str, torch.Tensor]], server_round: int = 1) -> None:
    """One round of FedAvg's train_round whose nodes send the model they got plus `changes`."""
    sent = fedavg.model.state_dict()
    states = [{k: t + change[k] if k in change else t.clone() for k, t in sent.items()} for change in changes]
    replies = {n.node_id: Reply({"num-examples": n.num_train, "train-loss": 1.0}, s) for n, s in zip(NODES, states)}
    fedavg.broadcast = lambda *args, **kwargs: replies
    fedavg.train_round(server_round, NODES)


def mean_change(changes: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Δ of a round: the nodes' changes, sample-weighted as FedAvg's mean weighs them."""
    return weighted_average(changes, [n.num_train for n in NODES])


def test_no_momentum_and_server_lr_1_is_plain_fedavg_bit_for_bit():
    for values in ({}, {"server-momentum": 0.0, "server-lr": 1.0}):
        fedavg = server(**values)
        sent = {k: t.clone() for k, t in fedavg.model.state_dict().items()}
        train(fedavg, offsets(1))
        states = [{k: t + c[k] if k in c else t for k, t in sent.items()} for c in offsets(1)]
        expected = weighted_average(states, [n.num_train for n in NODES])
        got = fedavg.model.state_dict()
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        assert fedavg.state().keys() == {"model"}  # no velocity kept


@pytest.mark.parametrize("beta, eta", [(0.9, 1.0), (0.5, 2.0), (0.0, 0.5)])
def test_two_rounds_with_momentum_land_on_the_closed_form(beta, eta):
    """v1 = Δ1, w1 = w0 + η·Δ1; v2 = β·Δ1 + Δ2, w2 = w1 + η·v2 = w0 + η(1 + β)·Δ1 + η·Δ2."""
    fedavg = server(**{"server-momentum": beta, "server-lr": eta})
    w0 = {k: t.clone() for k, t in fedavg.model.state_dict().items()}
    train(fedavg, offsets(1), 1)
    train(fedavg, offsets(2), 2)
    d1, d2 = mean_change(offsets(1)), mean_change(offsets(2))
    got = fedavg.model.state_dict()
    for key, d in d1.items():
        expected = w0[key] + eta * (1 + beta) * d + eta * d2[key]
        assert torch.allclose(got[key], expected, atol=1e-6), key


def test_a_resumed_server_goes_on_with_the_same_velocity():
    values = {"server-momentum": 0.9, "server-lr": 1.0}
    first = server(**values)
    train(first, offsets(1), 1)
    resumed = server(**values)
    resumed.load_state(first.state())
    train(first, offsets(2), 2)
    train(resumed, offsets(2), 2)
    a, b = first.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


REFUSED = {
    "momentum of 1": (["--run-config", "server-momentum=1.0"], "server-momentum must be in [0, 1)"),
    "negative server lr": (["--run-config", "server-lr=-1"], "server-lr must be in (0, 10]"),
    "pefll": (["--strategy", "pefll", "--run-config", "server-momentum=0.9"], "'pefll' takes no server step"),
    "fedattn": (["--strategy", "fedattn", "--run-config", "server-lr=2"], "'fedattn' takes no server step"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_what_server_momentum_does_not_take_is_one_line_and_exit_2(case, refuses_in_one_line):
    refuses_in_one_line(*REFUSED[case])
