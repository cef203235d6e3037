"""FedAttn: attention over one key, weights that sum to one, the server's chain-rule step through
the attention against autograd, and a federation that serves held-out clients."""

import pytest
import torch

from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.strategies.fedattn.server import BiasAttention, FedAttn


def test_one_neighbour_that_is_the_client_itself_gives_w_v_times_its_biases():
    torch.manual_seed(0)
    attention = BiasAttention(6, 4, 3, residual=False)
    torch.nn.init.normal_(attention.value.weight)  # not the identity it starts as
    z, m = torch.randn(6), torch.randn(4)
    with torch.no_grad():
        torch.testing.assert_close(attention(z, z[None], m[None], torch.zeros(4)), attention.value.weight @ m)


def test_attention_weights_are_a_distribution_over_the_neighbours():
    torch.manual_seed(1)
    attention = BiasAttention(6, 4, 3, residual=True)
    weights = attention.weights(torch.randn(6), torch.randn(5, 6))
    assert weights.shape == (5,) and (weights > 0).all()
    torch.testing.assert_close(weights.sum(), torch.tensor(1.0))
    z_n, m_n, m_bar = torch.randn(5, 6), torch.randn(5, 4), torch.randn(4)
    with torch.no_grad():  # W_V = I at the start: M̃ is the weighted mean of the neighbours' biases
        torch.testing.assert_close(attention(z_n[0], z_n, m_n, m_bar), attention.weights(z_n[0], z_n) @ m_n)


@pytest.mark.parametrize("reg", [0.0, 0.3])
def test_the_server_step_from_client_gradients_equals_autograd_of_the_clients_losses(reg):
    """Each client i reports g_i = ∂L_i/∂M̃_i; the server's backward through the attention must
    give ∇_W of mean_i L_i(M̃_i(W)) (+ reg·mean ‖M̃_i − M̄‖²), computed here end to end."""
    torch.manual_seed(2)
    cfg = RunConfig.from_mapping({"strategy": "fedattn", "model": "mlp", "fedattn-k": 3, "fedattn-reg": reg})
    server = FedAttn(cfg, None, (1, 8, 8), 4)
    torch.nn.init.normal_(server.attention.value.weight, std=0.1)
    server.remember({f"n{i}": (torch.randn(server.z_dim), torch.randn(server.m_dim)) for i in range(4)})
    targets = [torch.randn(server.m_dim) for _ in range(3)]
    clients = ["n0", "n1", "n3"]
    losses = lambda m, t: ((m - t) ** 2).sum() * 0.5 + (m**3).sum() * 0.01  # noqa: E731  any smooth local loss

    m_tildes = [server.personalize(server.memory[k][0])[0] for k in clients]
    leaves = [m.detach().requires_grad_() for m in m_tildes]  # what each client differentiates at
    gradients = [torch.autograd.grad(losses(leaf, t), leaf)[0] for leaf, t in zip(leaves, targets)]
    m_bar = server.mean_biases()
    server.backprop(m_tildes, gradients, m_bar)
    got = [p.grad.clone() for p in server.attention.parameters()]

    fresh = [server.personalize(server.memory[k][0])[0] for k in clients]
    total = sum(losses(m, t) + reg * ((m - m_bar) ** 2).sum() for m, t in zip(fresh, targets)) / len(clients)
    expected = torch.autograd.grad(total, list(server.attention.parameters()))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    assert all(e.norm() > 0 for e in expected)  # every matrix really gets a gradient


def test_fedattn_personalizes_seen_and_held_out_clients(tmp_path):
    cfg = RunConfig.from_mapping(
        {
            "strategy": "fedattn",
            "num-server-rounds": 4,
            "min-nodes": 6,
            "fedattn-warmup": 1,
            "fedattn-k": 3,
            "results-dir": str(tmp_path / "out"),
        }
    )
    results = run_in_process(cfg, 6)
    assert results["complete"] and not results["failures"]
    clients = results["clients"]
    assert all(c["accuracy"] is not None and c["neighbours"] == 3 for c in clients)
    assert any(not c["seen"] for c in clients)  # held out: Z under the global model, then M̃
    state = torch.load(tmp_path / "out" / "checkpoint.pt")["state"]
    value = state["attention"]["value.weight"]
    assert not torch.equal(value, torch.eye(value.shape[0]))


def test_a_broken_attention_falls_back_to_the_mean_biases_instead_of_sending_nan():
    server = FedAttn(RunConfig.from_mapping({"strategy": "fedattn", "model": "mlp"}), None, (1, 8, 8), 2)
    server.remember({f"n{i}": (torch.randn(server.z_dim), torch.randn(server.m_dim)) for i in range(2)})
    with torch.no_grad():
        server.attention.value.weight.fill_(float("inf"))
        m, weights = server.personalize(server.memory["n0"][0])
    torch.testing.assert_close(m, server.mean_biases())
    assert len(weights) == 0
