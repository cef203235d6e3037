"""PerFed-CKT: the nearest centroid, the k-means, the distillation term's gradient, the public
set's fingerprint check, sampling by data size, and a federation with three architectures."""

import copy
import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

from florist.cli import main
from florist.client.node import Node, Request
from florist.common import data as data_lib
from florist.common import folders, protocol, scenarios
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.server.strategy import NodeInfo
from florist.strategies.perfedckt import client as client_half
from florist.strategies.perfedckt.server import PerFedCKT, cluster, public_fingerprint
from florist.strategies.perfedckt.spec import CENTROIDS, SOFT, PublicSettings


def _cfg(**values) -> RunConfig:
    return RunConfig.from_mapping({"strategy": "perfed-ckt"} | {k.replace("_", "-"): v for k, v in values.items()})


def _fingerprint(cfg: RunConfig) -> str:
    return public_fingerprint(cfg, (1, 8, 8))


def test_nearest_centroid_is_the_argmin_of_squared_distances():
    rng = np.random.default_rng(0)
    for _ in range(50):
        centroids, soft = rng.normal(size=(4, 20, 10)), rng.normal(size=(20, 10))
        distances = [float(np.sum((c - soft) ** 2)) for c in centroids]
        assert client_half.nearest_centroid(soft, centroids) == int(np.argmin(distances))
    # Closest is not "most aligned": the largest inner product picks the long vector.
    soft = np.ones((2, 2))
    centroids = np.stack([np.full((2, 2), 5.0), np.full((2, 2), 0.9)])
    assert client_half.nearest_centroid(soft, centroids) == 1


def test_kmeans_is_deterministic_under_a_seed_and_never_asks_for_more_clusters_than_points():
    rng = np.random.default_rng(1)
    points = np.concatenate([rng.normal(m, 0.1, size=(5, 30)) for m in (-3, 0, 3)]).astype(np.float32)
    first, again = cluster(points, 3, seed=7), cluster(points, 3, seed=7)
    np.testing.assert_array_equal(first, again)
    assert sorted(np.round(first.mean(1)).tolist()) == [-3.0, 0.0, 3.0]  # the three blobs
    assert cluster(points[:2], 3, seed=7).shape == (2, 30)  # c ≤ m
    np.testing.assert_allclose(cluster(points, 1, seed=7)[0], points.mean(0), atol=1e-5)  # one cluster: the mean


def test_the_distillation_gradient_matches_the_closed_form():
    """For s(w, x) = Wx, ∇_W λ/|P|·Σ‖s̄(x) − Wx‖² = −2λ/|P|·Σ (s̄(x) − Wx) xᵀ."""
    torch.manual_seed(0)
    x, targets, lam = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64), 0.3
    w = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    client_half.distillation_loss(x @ w.T, targets, lam).backward()
    expected = -2 * lam / len(x) * (targets - x @ w.T.detach()).T @ x
    torch.testing.assert_close(w.grad, expected)


def _node(make_node, key="partition-0", run_id=1, node_config=None, **changes) -> Node:
    cfg = _cfg(**changes)
    client = scenarios.client_data(0, 10, cfg)
    node_config = {"partition-id": 0, "num-partitions": 10} | (node_config or {})
    return make_node(cfg.to_mapping(), key, client, node_config, run_id=run_id)


def _request(cfg: RunConfig, centroids: np.ndarray | None = None) -> Request:
    arrays = None if centroids is None else ArrayRecord({CENTROIDS: torch.from_numpy(centroids)})
    return Request(PublicSettings(public_hash=_fingerprint(cfg)), protocol.content(arrays))


def test_lambda_zero_trains_exactly_like_local_training(make_node):
    node = _node(make_node, ckt_lambda=0.0)
    public = data_lib.embedded_public(node.cfg.public_size, node.cfg.seed)
    model, _ = client_half._owned_model(node, 0)
    plain = copy.deepcopy(model)
    centroids = np.random.default_rng(0).normal(size=(3, len(public), 10)).astype(np.float32)
    client_half._fit(node, model, public, centroids, salt=0)
    node.fit(plain, node.cfg.local_epochs, salt=0, steps=node.cfg.settings.steps)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0)


def test_a_trained_node_keeps_its_model_for_the_run_and_sends_only_soft_decisions(make_node):
    node = _node(make_node, run_id=5)
    reply = client_half.train(node, _request(node.cfg))
    soft = reply.array_records[protocol.ARRAYS].to_torch_state_dict()
    assert list(soft) == [SOFT] and tuple(soft[SOFT].shape) == (node.cfg.public_size, 10)
    assert client_half._owned_model(node, 0)[1] is None  # as of round 0 (a resumed round one), none
    kept, meta = client_half._owned_model(node, 1)
    assert meta["rounds"] == 1 and meta["cluster"] == -1  # round one: no centroids, local training
    public = data_lib.embedded_public(node.cfg.public_size, node.cfg.seed)
    with torch.no_grad():
        torch.testing.assert_close(kept(torch.from_numpy(public)).softmax(1), soft[SOFT])  # probabilities by default
    node.run_id = 6
    assert client_half._owned_model(node, 1)[1] is None  # another run starts afresh


def test_a_node_whose_public_set_differs_refuses_to_train(tmp_path, make_node):
    other = tmp_path / "public"
    other.mkdir()
    np.savez(other / "public.npz", x=data_lib.load_digits()[0][:200])  # 200 digits, but not the same ones
    node = _node(make_node, node_config={"public-dir": str(other)})  # the node's own P, by its node config
    with pytest.raises(
        ValueError,
        match=r"node partition-0: its public set P \(from public-dir .*\) has fingerprint "
        r"200-[0-9a-f]{16}, but the server expects 200-",
    ):
        client_half.train(node, _request(_cfg()))
    assert client_half._owned_model(node, 1)[1] is None  # nothing trained, nothing saved
    # The same folder named on the server (or its fingerprint in public-hash) is accepted.
    agreed = _cfg(public_dir=str(other))
    assert _fingerprint(agreed) == data_lib.fingerprint(folders.folder_public(other, 10))
    client_half.train(node, _request(agreed))


def test_the_public_set_is_owned_by_no_client():
    public = set(data_lib._embedded_order(1)[:200].tolist())
    owned = set(np.concatenate(data_lib.partition_indices("dirichlet:0.3", 20, 1, 10, 200)).tolist())
    assert not public & owned and len(public | owned) == len(data_lib.load_digits()[1])


def test_clients_are_sampled_in_proportion_to_their_data():
    sizes = [10, 10, 10, 170]
    nodes = [NodeInfo(i, f"n{i}", True, n, 5, (1, 8, 8)) for i, n in enumerate(sizes)]
    strategy = PerFedCKT(_cfg(fraction_train=0.25, min_train_nodes=1), None, (1, 8, 8), 4)
    picks = [strategy.sample(nodes, r)[0].node_id for r in range(2000)]
    assert np.bincount(picks, minlength=4)[3] / 2000 == pytest.approx(170 / 200, abs=0.03)
    half = PerFedCKT(_cfg(fraction_train=0.5), None, (1, 8, 8), 4)
    assert all(len({n.node_id for n in half.sample(nodes, r)}) == 2 for r in range(50))  # without replacement


def test_three_architectures_train_together(tmp_path):
    cfg = _cfg(
        num_server_rounds=3,
        min_nodes=6,
        fraction_train=0.5,
        eval_every=1,
        client_models="cnn,mlp,cnn-wide",
        results_dir=str(tmp_path / "out"),
    )
    results = run_in_process(cfg, 6)
    clients = results["clients"]
    assert not results["failures"] and all(c["accuracy"] is not None for c in clients)
    assert len({c["num_params"] for c in clients}) == 3  # cnn, mlp and cnn-wide side by side
    assert any(c["cluster"] >= 0 for c in clients)  # picked a centroid after round one
    for row in results["rounds"]:  # soft decisions on P instead of models
        assert row["train_bytes_up"] > 0 and row["fedavg_bytes_up"] > 5 * row["train_bytes_up"]
    # The per-round accuracy counts only nodes that own a model: after round one, the 3 sampled of 5.
    evaluated = [{e["type"]: e["nodes"] for e in row["exchanges"]} for row in results["rounds"]]
    assert evaluated[0] == {"train.ckt": 3, "evaluate.ckt": 3}
    assert 3 <= evaluated[1]["evaluate.ckt"] <= evaluated[2]["evaluate.ckt"] <= 5
    state = torch.load(tmp_path / "out" / "checkpoint.pt")["state"]
    assert (
        tuple(state["centroids"].shape)[1:] == (cfg.public_size, 10)
        and len(state["centroids"]) <= cfg.settings.clusters
    )
    report = (tmp_path / "out" / "report.md").read_text()
    assert "FedAvg with the same clients" in report and "Accuracy per client model" in report
    assert json.loads((tmp_path / "out" / "results.json").read_text())["complete"]


def test_public_hash_prints_the_fingerprint_nodes_check(tmp_path, capsys):
    folder = tmp_path / "public"
    folder.mkdir()
    x = data_lib.load_digits()[0][:50]
    np.savez(folder / "public.npz", x=x)
    assert main(["public-hash", str(folder)]) == 0
    assert capsys.readouterr().out.strip() == f'public-hash = "{data_lib.fingerprint(x)}"'
    assert main(["public-hash", str(tmp_path / "missing")]) == 2  # a clear error, no traceback


def test_soft_decisions_are_logits_or_probabilities(make_node):
    node = _node(make_node)
    public = data_lib.embedded_public(node.cfg.public_size, node.cfg.seed)
    model, _ = client_half._owned_model(node, 0)
    logits = client_half.soft_decisions(_node(make_node, ckt_soft="logits"), model, public)
    probs = client_half.soft_decisions(_node(make_node, ckt_soft="probs"), model, public)
    np.testing.assert_allclose(probs, torch.from_numpy(logits).softmax(1).numpy(), rtol=1e-6)
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-5)


@pytest.mark.parametrize(("unseen", "distilled"), [("rounds", False), ("paper", True)])
def test_a_node_without_a_model_trains_as_ckt_unseen_says(make_node, unseen, distilled):
    """`rounds`: its first round is local training (no centroid); `paper`: distilled toward the
    nearest final centroid from its first round on, as Algorithm 1 trains a late first pick."""
    node = _node(make_node, ckt_unseen=unseen, ckt_steps=2)
    centroids = np.random.default_rng(0).dirichlet(np.ones(10), size=(3, node.cfg.public_size)).astype(np.float32)
    arrays = ArrayRecord({CENTROIDS: torch.from_numpy(centroids)})
    request = Request(PublicSettings(public_hash=_fingerprint(node.cfg), scratch_rounds=1), protocol.content(arrays))
    client_half.evaluate(node, request)
    assert (client_half._owned_model(node, 1)[1]["cluster"] >= 0) == distilled
