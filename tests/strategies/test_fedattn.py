"""FedAttn: attention over one key, weights that sum to one, whether a client attends over
itself, what a client the server does not know yet gets, the client's gradient and the server's
chain-rule step against autograd of the written-out objective, and a federation that serves
held-out clients."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from florist.common.models import flat_biases
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.server.strategy import NodeInfo, Reply
from florist.strategies.fedattn import client
from florist.strategies.fedattn.server import BiasAttention, FedAttn
from florist.strategies.fedattn.spec import BIAS_GRAD, Z


def attention_server(num_seen: int = 6, **settings) -> FedAttn:
    """A FedAttn server half on the MLP (no network: `exchanger` only names the run)."""
    cfg = RunConfig.from_mapping({"strategy": "fedattn", "model": "mlp"} | settings)
    return FedAttn(cfg, SimpleNamespace(run_id=1), (1, 8, 8), num_seen)


def test_one_key_takes_all_the_weight_so_the_output_is_w_v_times_its_biases():
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


# -- a client among its own neighbours (`fedattn-include-self`) ----------------------------


@pytest.mark.parametrize("include_self", [True, False])
def test_include_self_decides_whether_a_trained_clients_own_biases_are_attended(include_self):
    """On, client n0's own entry is its nearest key (distance 0) beside its K − 1 nearest others,
    and its own stored M moves its M̃; off, it attends over its K nearest others only, and its
    own M cannot change its M̃. A client the server keeps nothing of is never left out."""
    server = attention_server(**{"fedattn-k": 3, "fedattn-include-self": include_self})
    gen = torch.Generator().manual_seed(3)
    zs = {f"n{i}": torch.randn(server.z_dim, generator=gen) for i in range(6)}
    server.remember({key: (z, torch.randn(server.m_dim, generator=gen)) for key, z in zs.items()})
    torch.nn.init.normal_(server.attention.value.weight, std=0.1)  # any W_V, not the identity
    others = sorted((k for k in zs if k != "n0"), key=lambda k: float((zs[k] - zs["n0"]).norm()))
    assert server.neighbours(zs["n0"], "n0") == (["n0", *others[:2]] if include_self else others[:3])
    assert server.neighbours(zs["n0"], "stranger") == ["n0", *others[:2]]  # by key, not by distance
    with torch.no_grad():
        before, weights = server.personalize(zs["n0"], "n0")
        server.remember({"n0": (zs["n0"], server.memory["n0"][1] + 5.0)})  # its own biases, same Z
        after, _ = server.personalize(zs["n0"], "n0")
    assert len(weights) == 3
    assert torch.equal(before, after) is not include_self


# -- a sampled client the server keeps nothing of ------------------------------------------


def one_round(keys: list[str], gradients: dict[str, torch.Tensor]) -> tuple[FedAttn, dict, list, torch.Tensor]:
    """One attended training round (no warm-up) of a server that knows n0…n3, with `keys`
    sampled; each node replies with the model it was sent, a random Z and `gradients[key]`.
    Returns the server, the biases each node was sent, W before the round, and M̄ before it."""
    server = attention_server(**{"fedattn-warmup": 0, "fedattn-k": 3})
    gen = torch.Generator().manual_seed(4)
    memory = {
        f"n{i}": (torch.randn(server.z_dim, generator=gen), torch.randn(server.m_dim, generator=gen)) for i in range(4)
    }
    server.remember(memory)
    nodes = [NodeInfo(100 + i, key, True, 10, 5, (1, 8, 8)) for i, key in enumerate(keys)]
    start, m_bar, sent = [p.detach().clone() for p in server.attention.parameters()], server.mean_biases(), {}

    def ask(exchange, requests, server_round, required, reference=None, side=None):
        replies = {}
        for node in nodes:
            state = requests[node.node_id].array_records["arrays"].to_torch_state_dict()
            sent[node.key] = flat_biases(state, server.biases)
            z = torch.randn(server.z_dim, generator=gen)
            replies[node.node_id] = Reply(
                {"num-examples": 10, "train-loss": 1.0}, state, {Z: z, BIAS_GRAD: gradients[node.key]}
            )
        return replies

    server.ask = ask
    server.train_round(1, nodes)
    return server, sent, start, m_bar


def test_a_sampled_client_the_server_does_not_know_trains_from_the_mean_biases_and_leaves_w_alone():
    """It gets M̄ (which W_Q, W_K, W_V do not shape), so its gradient, however large, moves them
    by nothing: the step equals the step of the known client alone. It is known afterwards."""
    gen = torch.Generator().manual_seed(5)
    known, huge = torch.randn(attention_server().m_dim, generator=gen), torch.full((attention_server().m_dim,), 1e6)
    both, sent, start, m_bar = one_round(["n1", "new"], {"n1": known, "new": huge})
    alone, _, _, _ = one_round(["n1"], {"n1": known})
    stranger, stranger_sent, stranger_start, stranger_m_bar = one_round(["new"], {"new": huge})
    assert torch.equal(sent["new"], m_bar) and not torch.allclose(sent["n1"], m_bar)
    for p, q, w in zip(both.attention.parameters(), alone.attention.parameters(), start):
        assert torch.equal(p, q) and not torch.equal(p, w)  # moved, by the known client only
    assert torch.equal(stranger_sent["new"], stranger_m_bar)
    assert all(torch.equal(p, w) for p, w in zip(stranger.attention.parameters(), stranger_start))
    assert "new" in stranger.memory and "new" in both.memory


# -- the client's gradient and the server's step against the written-out objective ----------


def written_out_biases(w: list[torch.Tensor], z, z_n, m_n, m_bar) -> torch.Tensor:
    """M̃ = M̄ + softmax((W_K Z_N)ᵀ(W_Q z)/√d_k) · W_V (M_N − M̄), from the matrices themselves."""
    w_q, w_k, w_v = w
    a = torch.softmax((z_n @ w_k.T) @ (w_q @ z) / math.sqrt(w_q.shape[0]), dim=0)
    return m_bar + (a @ (m_n - m_bar)) @ w_v.T


def written_out_loss(model, names: list[str], m: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The client's training loss: mean cross-entropy of G with its biases (in `names` order) set to m."""
    params, offset = dict(model.named_parameters()), 0
    for name in names:
        size = params[name].numel()
        params[name], offset = m[offset : offset + size].reshape(params[name].shape), offset + size
    return F.cross_entropy(torch.func.functional_call(model, params, (x,)), y)


@pytest.mark.parametrize("reg", [0.0, 0.3])
def test_the_clients_gradient_and_the_servers_step_equal_autograd_of_the_written_out_objective(reg):
    """float64: each client computes ∂L_i/∂M̃_i with its own code (`client.bias_gradient`) at the
    biases the server sent; the server backpropagates them. Both must equal autograd of
    mean_i L_i(G, M̃_i(W)) + reg·mean_i ‖M̃_i − M̄‖², written out here with no FedAttn code but
    the neighbour search: a wrong sign, scale or term on either side fails."""
    server = attention_server(**{"fedattn-k": 3, "fedattn-reg": reg})
    server.model.double(), server.attention.double()
    torch.nn.init.normal_(server.attention.value.weight, std=0.1)
    gen, rng = torch.Generator().manual_seed(6), np.random.default_rng(6)
    draw = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    server.remember({f"n{i}": (draw(server.z_dim), 0.1 * draw(server.m_dim)) for i in range(5)})
    data = {k: (rng.random((12, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 12)) for k in ("n0", "n3")}
    m_bar, g_model = server.mean_biases(), server.new_model().double()
    g_model.load_state_dict(server.model.state_dict())
    m_tildes, gradients, total = [], [], 0.0
    for key, (x, y) in data.items():
        m_tilde, _ = server.personalize(server.memory[key][0], key)
        model = server.new_model().double()
        model.load_state_dict(server.with_biases(m_tilde))
        node = SimpleNamespace(
            key=key, device=torch.device("cpu"), data=SimpleNamespace(labelled=True, x_train=x, y_train=y)
        )
        m_tildes.append(m_tilde), gradients.append(client.bias_gradient(node, model))

        x64, y64 = torch.from_numpy(x).double(), torch.from_numpy(y)
        leaf = m_tilde.detach().requires_grad_()
        expected_g = torch.autograd.grad(written_out_loss(g_model, server.biases, leaf, x64, y64), leaf)[0]
        torch.testing.assert_close(gradients[-1], expected_g, rtol=1e-10, atol=1e-13)

        near = server.neighbours(server.memory[key][0], key)
        z_n, m_n = (torch.stack([server.memory[k][i] for k in near]) for i in (0, 1))
        m = written_out_biases(list(server.attention.parameters()), server.memory[key][0], z_n, m_n, m_bar)
        torch.testing.assert_close(m, m_tilde, rtol=1e-12, atol=1e-14)
        total = total + written_out_loss(g_model, server.biases, m, x64, y64) + reg * ((m - m_bar) ** 2).sum()
    server.backprop(m_tildes, gradients, m_bar)
    expected = torch.autograd.grad(total / len(data), list(server.attention.parameters()))
    for p, e in zip(server.attention.parameters(), expected):
        assert e.norm() > 0  # every matrix really gets a gradient
        torch.testing.assert_close(p.grad, e, rtol=1e-9, atol=1e-13)
