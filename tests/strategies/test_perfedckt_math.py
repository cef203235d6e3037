"""PerFed-CKT's Eq. 2 through the softmax, checked against an objective written out here: one
local step of the client half on a real CNN moves the weights by −lr·∇ of

    F_k(w) + λ/|P|·Σ_{x∈P} ‖s̄_k(x) − softmax(f(w, x))‖²,

with F_k the mean cross-entropy on the client's train split, s̄_k the centroid nearest to the
client's soft decisions and the softmax spelled out as exp(z)/Σexp(z). Full batches make the
step deterministic up to the order of the samples, which a mean does not see. The same check
fails for a distillation term that is wrong in any one way (sign, logits, λ, sum, square), so
it is not passing by accident; with λ = 0 none of those would show."""

import copy

import numpy as np
import pytest
import torch

from florist.common import data as data_lib
from florist.strategies.perfedckt import client as client_half

LAMBDA, LR, PUBLIC = 2.0, 0.1, 60


def _node(make_node):
    values = {
        "strategy": "perfed-ckt",
        "partition": "iid",
        "public-size": PUBLIC,
        "ckt-public-batch": 512,  # all of P in every step
        "batch-size": 4096,  # all of the train split in every step
        "ckt-steps": 1,
        "ckt-lambda": LAMBDA,
        "lr": LR,
        "momentum": 0.0,
        "weight-decay": 0.0,
    }
    return make_node(values, key="partition-0")


def _written_out_objective(model, x, y, public, centroids) -> torch.Tensor:
    """F_k(w) + λ/|P|·Σ‖s̄_k(x) − s(w, x)‖², from scratch: the nearest centroid by squared
    distance over all of P, the softmax as exp(z − max)/Σexp(z − max)."""
    with torch.no_grad():
        z = model(torch.from_numpy(public))
        probs = (z - z.max(1, keepdim=True).values).exp()
        probs = probs / probs.sum(1, keepdim=True)
        distances = [float(((torch.from_numpy(c) - probs) ** 2).sum()) for c in centroids]
    s_bar = torch.from_numpy(centroids[int(np.argmin(distances))])
    logits = model(torch.from_numpy(x))
    log_probs = logits - logits.max(1, keepdim=True).values
    log_probs = log_probs - log_probs.exp().sum(1, keepdim=True).log()
    f_k = -log_probs[torch.arange(len(y)), torch.from_numpy(y)].mean()
    z = model(torch.from_numpy(public))
    e = (z - z.max(1, keepdim=True).values).exp()
    s = e / e.sum(1, keepdim=True)
    return f_k + LAMBDA / len(public) * ((s_bar - s) ** 2).sum()


def _one_step(node, centroids):
    """(weights before, after one step of the client half, expected from the written-out objective)."""
    public = data_lib.embedded_public(PUBLIC, node.cfg.seed)
    model, _ = client_half._owned_model(node, 0)
    reference = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    client_half._fit(node, model, public, centroids, salt=0)
    reference.train()
    x = node.data.x_train.astype(np.float32)
    objective = _written_out_objective(reference, x, node.data.y_train, public, centroids)
    grads = dict(
        zip([n for n, _ in reference.named_parameters()], torch.autograd.grad(objective, list(reference.parameters())))
    )
    expected = {k: before[k] - LR * grads[k] for k in grads}
    return before, dict(model.named_parameters()), expected


def _centroids(seed: int = 0) -> np.ndarray:
    """Three centroids on the simplex, far from a fresh model's near-uniform soft decisions."""
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.full(10, 0.3), size=(3, PUBLIC)).astype(np.float32)


def _matches(after, expected) -> bool:
    return all(torch.allclose(after[k].detach(), expected[k], rtol=1e-4, atol=1e-6) for k in expected)


def test_one_local_step_follows_eq_2_through_the_softmax(make_node):
    node = _node(make_node)
    before, after, expected = _one_step(node, _centroids())
    assert _matches(after, expected)
    # The distillation term is a sizeable part of this step, not lost in the tolerance.
    plain, _ = client_half._owned_model(node, 0)
    plain.load_state_dict(before)
    client_half._fit(node, plain, data_lib.embedded_public(PUBLIC, node.cfg.seed), None, salt=0)
    moved = max(float((after[k] - dict(plain.named_parameters())[k]).detach().abs().max()) for k in expected)
    assert moved > 1e-4  # a hundred times the tolerance


WRONG_TERMS = {
    "sign flipped": lambda soft, targets, lam: -lam * ((targets - soft) ** 2).sum(1).mean(),
    "λ missing": lambda soft, targets, lam: ((targets - soft) ** 2).sum(1).mean(),
    "mean over classes, not the sum": lambda soft, targets, lam: lam * ((targets - soft) ** 2).mean(),
    "no square": lambda soft, targets, lam: lam * (targets - soft).abs().sum(1).mean(),
    "summed over P, not averaged": lambda soft, targets, lam: lam * ((targets - soft) ** 2).sum(),
}


@pytest.mark.parametrize("wrong", WRONG_TERMS, ids=list(WRONG_TERMS))
def test_a_wrong_distillation_term_fails_the_same_check(make_node, monkeypatch, wrong):
    monkeypatch.setattr(client_half, "distillation_loss", WRONG_TERMS[wrong])
    _, after, expected = _one_step(_node(make_node), _centroids())
    assert not _matches(after, expected)


def test_logits_instead_of_probabilities_fail_the_same_check(make_node, monkeypatch):
    """`ckt-soft = logits` is a setting; as the default it would not be Eq. 2."""
    node = _node(make_node)
    monkeypatch.setattr(client_half, "_soft", lambda node, logits: logits)
    _, after, expected = _one_step(node, _centroids())
    assert not _matches(after, expected)
