"""OD-PFL: the set encoder's guarantees, the Gaussian mechanism, the client that noises its own
descriptor, and a federation in which held-out clients are served without showing a label."""

import math

import numpy as np
import pytest
import torch
from flwr.app import RecordDict
from torch.optim.optimizer import register_optimizer_step_post_hook

from florist.client.node import Node, Request
from florist.common import data as data_lib
from florist.common import folders, protocol
from florist.common.settings import NoSettings
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.strategies.pefll import client as client_half
from florist.strategies.pefll.client import gaussian_sigma, privatize
from florist.strategies.pefll.networks import SetEncoder
from florist.strategies.pefll.spec import DESCRIPTOR, DescribeSettings


def test_sigma_is_the_gaussian_mechanism_for_a_mean_of_unit_vectors():
    sensitivity = 2 / 50
    assert gaussian_sigma(0.5, 1e-5, 50) == pytest.approx(math.sqrt(2 * sensitivity**2 * math.log(1.25e5)) / 0.5)
    assert gaussian_sigma(math.inf, 1e-5, 50) == 0.0


@pytest.mark.parametrize(
    ("epsilon", "delta", "size", "message"),
    [
        (0.0, 1e-5, 10, "dp-epsilon must be > 0"),
        (-1.0, 1e-5, 10, "dp-epsilon must be > 0"),
        (1.0, 0.0, 10, r"dp-delta must be in \(0, 1\)"),
        (1.0, 1.0, 10, r"dp-delta must be in \(0, 1\)"),
        (1.0, 1e-5, 0, r"\|D\| = 0"),
    ],
)
def test_invalid_privacy_settings_are_refused_by_name(epsilon, delta, size, message):
    with pytest.raises(ValueError, match=message):
        gaussian_sigma(epsilon, delta, size)


def test_the_noise_has_the_requested_spread():
    draws = torch.stack([privatize(torch.zeros(8), 0.3) for _ in range(2000)])
    assert draws.std().item() == pytest.approx(0.3, rel=0.05) and abs(draws.mean().item()) < 0.01


def test_set_encoder_ignores_order_and_chunking_and_moves_at_most_two_over_n():
    torch.manual_seed(0)
    encoder, x = SetEncoder((1, 8, 8), 10, 6), torch.rand(40, 1, 8, 8)
    with torch.no_grad():
        g = encoder.describe(x)
        torch.testing.assert_close(encoder.describe(x[torch.randperm(40)]), g, atol=1e-6, rtol=0)
        torch.testing.assert_close(encoder.describe(x, chunk=7), g, atol=1e-6, rtol=0)
        for _ in range(20):  # replace one sample by anything: the sensitivity bound holds
            other = x.clone()
            other[torch.randint(40, ())] = torch.rand(1, 8, 8) * 10
            assert (encoder.describe(other) - g).norm() <= 2 / 40 + 1e-6


def _unlabeled_node(tmp_path, make_node, **node_config) -> Node:
    folder = tmp_path / "data"
    folder.mkdir()
    x, _ = data_lib.load_digits()
    np.savez(folder / "train.npz", x=x[:60])
    np.savez(folder / "test.npz", x=x[60:70])
    client = folders.folder_client(folder, 10, 1, 0.15)
    return make_node({"strategy": "odpfl"}, "newcomer", client, node_config, seen=False)


def _served(node: Node, encoder: SetEncoder) -> RecordDict:
    request = Request(
        DescribeSettings(embed_dim=6, predict=True, serve=True), protocol.content(protocol.to_record(encoder))
    )
    return client_half.describe(node, request)


@pytest.mark.parametrize(("epsilon", "analytic"), [(0.5, 0), (1.0, 1)])
def test_a_served_unlabeled_node_noises_its_descriptor_before_sending_it(tmp_path, make_node, epsilon, analytic):
    torch.manual_seed(0)
    encoder = SetEncoder((1, 8, 8), 10, 6)
    node = _unlabeled_node(tmp_path, make_node, **{"dp-epsilon": epsilon, "dp-delta": 1e-5})
    assert not node.data.labelled
    with torch.no_grad():
        clean = encoder.describe(torch.from_numpy(node.data.x_train))
    sent = [_served(node, encoder) for _ in range(2)]
    descriptors = [s.array_records[protocol.ARRAYS].to_torch_state_dict()[DESCRIPTOR] for s in sent]
    metrics = sent[0].metric_records[protocol.METRICS]
    n = len(node.data.x_train)
    assert metrics["num-examples"] == n and metrics["dp-epsilon"] == epsilon and metrics["dp-delta"] == 1e-5
    assert metrics["dp-sigma"] == pytest.approx(gaussian_sigma(epsilon, 1e-5, n))
    assert metrics["dp-analytic"] == analytic  # which calibration gave σ: classic below ε = 1
    assert not torch.allclose(descriptors[0], clean, atol=1e-4)  # what leaves the node is not the clean one
    assert not torch.allclose(descriptors[0], descriptors[1])  # fresh noise every time


def test_without_privacy_the_served_descriptor_is_the_clean_encoding(tmp_path, make_node):
    torch.manual_seed(0)
    encoder = SetEncoder((1, 8, 8), 10, 6)
    node = _unlabeled_node(tmp_path, make_node)
    sent = _served(node, encoder)
    with torch.no_grad():
        clean = encoder.describe(torch.from_numpy(node.data.x_train))
    torch.testing.assert_close(sent.array_records[protocol.ARRAYS].to_torch_state_dict()[DESCRIPTOR], clean)
    assert sent.metric_records[protocol.METRICS]["dp-sigma"] == 0.0
    assert "dp-analytic" not in sent.metric_records[protocol.METRICS]


def test_odpfl_serves_held_out_clients_from_their_unlabeled_data(tmp_path):
    values = {
        "strategy": "odpfl",
        "num-server-rounds": 5,
        "partition": "pathological:2",
        "min-nodes": 6,
        "eval-every": 0,
        "dp-epsilon": 3.0,
        "results-dir": str(tmp_path / "run"),
    }
    results = run_in_process(RunConfig.from_mapping(values), 6)
    [novel] = [c for c in results["clients"] if not c["seen"]]
    assert novel["dp_epsilon"] == 3.0 and novel["descriptor_size"] == novel["num_train"] and novel["dp_analytic"] == 1
    assert novel["dp_sigma"] == pytest.approx(gaussian_sigma(3.0, 1e-5, novel["num_train"]))
    assert all("dp_sigma" not in c for c in results["clients"] if c["seen"])  # noise is for nodes being served
    report = (tmp_path / "run" / "report.md").read_text()
    assert f"| {novel['client']} | {novel['num_train']} | 3 | 1e-05 | {novel['dp_sigma']:.4f} | analytic |" in report
    assert all(math.isfinite(r["train_loss"]) for r in results["rounds"])
    assert results["summary"]["seen"]["mean_accuracy"] > 0.5  # two classes per client; chance over ten is 0.1


def test_the_set_encoder_normalises_on_request_and_reads_the_mean_out_through_psi():
    torch.manual_seed(0)
    x = torch.rand(30, 1, 8, 8)
    free = SetEncoder((1, 8, 8), 10, 6, normalize=False)
    assert not torch.allclose(free(x).norm(dim=1), torch.ones(30))
    sphere = SetEncoder((1, 8, 8), 10, 6, psi="mlp")
    torch.testing.assert_close(sphere(x).norm(dim=1), torch.ones(30))
    with torch.no_grad():
        torch.testing.assert_close(sphere.describe(x), sphere.psi(sphere(x).mean(0)))
    with pytest.raises(ValueError, match="odpfl-psi"):
        SetEncoder((1, 8, 8), 10, 6, psi="transformer")


@pytest.mark.parametrize(("normalize", "epsilon", "expected"), [("always", math.inf, True), ("dp", math.inf, False)])
def test_odpfl_normalize_dp_normalises_only_when_the_run_is_private(normalize, epsilon, expected):
    cfg = RunConfig.from_mapping({"strategy": "odpfl", "odpfl-normalize": normalize, "dp-epsilon": epsilon})
    assert cfg.settings.normalized is expected
    private = RunConfig.from_mapping({"strategy": "odpfl", "odpfl-normalize": "dp", "dp-epsilon": 1.0})
    assert private.settings.normalized


@pytest.mark.parametrize("psi", ["identity", "mlp"])
def test_a_noising_node_normalises_even_when_the_server_says_not_to_and_noises_before_psi(tmp_path, make_node, psi):
    """The node's privacy never rests on the server: with a finite ε it puts φ on the unit
    sphere (the 2/|D| bound) although the request says the run's encoder is not normalised,
    and the noise goes on the mean, before ψ. A huge ε makes the noise negligible, so what is
    sent is ψ(mean of unit vectors)."""
    torch.manual_seed(0)
    node = _unlabeled_node(tmp_path, make_node, **{"dp-epsilon": 1e7})
    node = make_node({"strategy": "odpfl", "odpfl-psi": psi}, "newcomer", node.data, {"dp-epsilon": 1e7}, seen=False)
    encoder = SetEncoder((1, 8, 8), 10, 6, normalize=False, psi=psi)
    request = Request(
        DescribeSettings(embed_dim=6, predict=True, serve=True, normalize=False),
        protocol.content(protocol.to_record(encoder)),
    )
    sent = client_half.describe(node, request).array_records[protocol.ARRAYS].to_torch_state_dict()[DESCRIPTOR]
    encoder.normalize = True
    with torch.no_grad():
        expected = encoder.describe(torch.from_numpy(node.data.x_train))
    torch.testing.assert_close(sent, expected, atol=1e-4, rtol=0)
    encoder.normalize = False
    with torch.no_grad():
        assert not torch.allclose(sent, encoder.describe(torch.from_numpy(node.data.x_train)), atol=1e-2)


def _optimizer_steps(node: Node) -> int:
    """The optimizer steps one message 2 takes on `node`, counted as torch takes them."""
    taken = []
    hook = register_optimizer_step_post_hook(lambda *_: taken.append(1))
    try:
        client_half.train(node, Request(NoSettings(), protocol.content(protocol.to_record(node.new_model()))))
    finally:
        hook.remove()
    return len(taken)


@pytest.mark.parametrize("epochs", [0, 1, 3])
def test_odpfl_local_epochs_trains_e_passes_of_the_train_split_and_zero_keeps_the_steps(make_node, epochs):
    """Algorithm 1's E local epochs: ⌈n/B⌉·E optimizer steps; 0 keeps `hn-local-steps` (5 here)."""
    values = {"strategy": "odpfl", "odpfl-local-epochs": epochs, "hn-local-steps": 5, "batch-size": 16}
    node = make_node(values)
    n = len(node.data.x_train)
    assert n % 16 and math.ceil(n / 16) != 5  # a last short batch counts; one epoch is not k steps
    expected = math.ceil(n / 16) * epochs if epochs else 5
    assert _optimizer_steps(node) == expected == node.steps_taken


def test_odpfl_local_epochs_is_refused_below_zero_by_name():
    with pytest.raises(ValueError, match="odpfl-local-epochs must be >= 0"):
        RunConfig.from_mapping({"strategy": "odpfl", "odpfl-local-epochs": -1})
