"""PeFLL's (and OD-PFL's) server step: the three optimizers against torch.optim itself, the
clipping of the update direction, the authors' descriptor standardization and the embedding
networks a run may choose."""

import dataclasses

import pytest
import torch

from florist.apps.server import server_half
from florist.common.models import build_model
from florist.config import RunConfig
from florist.strategies.pefll.networks import EmbeddingNet, HyperNetwork, Standardizer
from florist.strategies.pefll.server import server_optimizer
from florist.strategies.pefll.spec import ENCODERS, HyperNetSettings


def _networks(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    return HyperNetwork(build_model("cnn", (1, 8, 8), 10), 3), EmbeddingNet((1, 8, 8), 10, 3)


def _step(settings: HyperNetSettings, steps: int = 3) -> list[torch.Tensor]:
    """The parameters after `steps` optimizer steps on the same seeded gradients."""
    hyper, embed = _networks()
    return _seeded_steps(server_optimizer(settings, hyper, embed), [*hyper.parameters(), *embed.parameters()], steps)


def _seeded_steps(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
    """`steps` optimizer steps, each on gradients drawn from the same seeded generator."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
    return [p.detach().clone() for p in params]


def _reference(optimizer: type[torch.optim.Optimizer], lr: float, decays: tuple[float, float], steps: int = 3):
    """The same steps taken by `torch.optim` directly, one weight decay per network."""
    hyper, embed = _networks()
    groups = [{"params": list(net.parameters()), "weight_decay": d} for net, d in zip((hyper, embed), decays)]
    return _seeded_steps(optimizer(groups, lr=lr), [*hyper.parameters(), *embed.parameters()], steps)


SETTINGS = HyperNetSettings(server_lr=0.01, l2_hyper=0.3, l2_embed=0.1)


@pytest.mark.parametrize(
    ("name", "reference", "decays"),
    [
        ("adam", torch.optim.Adam, (0.0, 0.0)),  # the authors' script: no weight decay at all
        ("adamw", torch.optim.AdamW, (0.6, 0.2)),  # weight decay 2λ_h, 2λ_v, decoupled
        ("sgd", torch.optim.SGD, (0.6, 0.2)),  # η ← (1 − 2sλ)η + s·mean Δη
    ],
)
def test_each_server_optimizer_is_torch_optim_s_own(name, reference, decays):
    got = _step(dataclasses.replace(SETTINGS, optimizer=name))
    for a, b in zip(got, _reference(reference, SETTINGS.server_lr, decays)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_adam_and_adamw_differ_exactly_by_the_decoupled_weight_decay():
    """One step from η₀ on the same gradient: AdamW's η equals Adam's minus s·2λ·η₀."""
    hyper, embed = _networks()
    start = [p.detach().clone() for p in [*hyper.parameters(), *embed.parameters()]]
    adam = _step(dataclasses.replace(SETTINGS, optimizer="adam"), steps=1)
    adamw = _step(dataclasses.replace(SETTINGS, optimizer="adamw"), steps=1)
    count = len(list(hyper.parameters()))
    for i, (a, w, p0) in enumerate(zip(adam, adamw, start)):
        decay = 2 * (SETTINGS.l2_hyper if i < count else SETTINGS.l2_embed)
        torch.testing.assert_close(w, a - SETTINGS.server_lr * decay * p0, atol=1e-7, rtol=0)
        assert not torch.equal(w, a)


def _server(**overrides):
    values = {"strategy": "pefll", "hn-embed-dim": 3, "hn-optimizer": "sgd", "hn-server-lr": 1.0}
    values |= {"hn-l2-hyper": 0.0, "hn-l2-embed": 0.0} | overrides
    return server_half("pefll")(RunConfig.from_mapping(values), None, (1, 8, 8), 4)


def _moved(clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The networks' change under one plain SGD step of size 1 on two clients' large updates,
    and the mean pseudo-gradient it came from."""
    server = _server(**{"hn-grad-clip": clip})
    nets = (server.hyper, server.embed)
    before = torch.cat([p.detach().flatten().clone() for net in nets for p in net.parameters()])
    generator = torch.Generator().manual_seed(2)
    steps = {}
    for node in (1, 2):
        theta = server.hyper(torch.randn(3, generator=generator))
        delta = {k: 100 * torch.randn(t.shape, generator=generator) for k, t in theta.items()}
        d_embed = {k: 100 * torch.randn(p.shape, generator=generator) for k, p in server.embed.named_parameters()}
        steps[node] = (theta, delta, d_embed)
    server.update(steps)
    after = torch.cat([p.detach().flatten() for net in nets for p in net.parameters()])
    return after - before, before


@pytest.mark.parametrize("clip", [50.0, 3.0])
def test_clipping_bounds_the_norm_of_the_update_and_keeps_its_direction(clip):
    free, _ = _moved(0.0)
    clipped, _ = _moved(clip)
    assert free.norm() > 10 * clip  # the test's updates are large enough to be clipped
    assert clipped.norm() <= clip * (1 + 1e-4)
    torch.testing.assert_close(clipped, free * (clip / free.norm()), atol=1e-5, rtol=1e-4)


def test_standardization_keeps_m_and_s_fixed_and_lets_gradients_through():
    """Once fitted (tests/strategies/test_pefll_robust.py checks the fit), m and s stay, and Δv
    reaches the encoder scaled by 1/s."""
    standardize = Standardizer(True)
    first, later = torch.tensor([1.0, 2.0, 6.0]), torch.tensor([3.0, -1.0, 0.0], requires_grad=True)
    standardize.fit(first[None])
    torch.testing.assert_close(standardize(first), (first - 3.0) / first.std())
    out = standardize(later)  # m and s stay those of the fit
    torch.testing.assert_close(out, (later.detach() - 3.0) / first.std())
    (grad,) = torch.autograd.grad(out.sum(), later)
    torch.testing.assert_close(grad, torch.full((3,), 1 / first.std().item()))
    assert torch.equal(Standardizer(False)(later), later)


@pytest.mark.parametrize("kind", ENCODERS)
@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32), (64,)])
def test_every_embedding_network_describes_images_and_vectors_and_reads_the_labels(kind, shape):
    torch.manual_seed(0)
    net = EmbeddingNet(shape, 10, 4, kind=kind)
    x, y = torch.rand(6, *shape), torch.tensor([0, 1, 2, 0, 1, 2])
    v = net.describe(x, y)
    assert v.shape == (4,) and torch.isfinite(v).all()
    assert not torch.allclose(v, net.describe(x, (y + 3) % 10), atol=1e-6)  # other labels, another descriptor


def test_unknown_settings_are_refused_by_key():
    for key, value in (("hn-optimizer", "adamx"), ("hn-encoder", "conv"), ("hn-grad-clip", -1.0)):
        with pytest.raises(ValueError, match=key):
            RunConfig.from_mapping({"strategy": "pefll", key: value})
