"""The shift scenarios and Synthetic(α, β): what each client holds, checked against the
definitions, and that a run records and reports each client's cluster."""

import json

import numpy as np
import pytest

from florist.common import data as data_lib
from florist.common import scenarios
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process


def _cfg(**values) -> RunConfig:
    return RunConfig.from_mapping({"partition": "iid"} | values)


def test_relabel_gives_each_cluster_its_own_permutation_of_the_same_digits():
    cfg, num = _cfg(shift="relabel:3"), 9
    clusters = [scenarios.cluster_of(i, num, 3, cfg.seed) for i in range(num)]
    assert sorted(clusters) == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # balanced, not in partition order
    assert clusters != sorted(clusters)
    perms = [scenarios.label_permutation(k, 10, cfg.seed) for k in range(3)]
    assert all(sorted(p) == list(range(10)) for p in perms) and len({tuple(p) for p in perms}) == 3
    for i in range(num):
        plain = data_lib.embedded_client(i, num, "iid", cfg.seed, cfg.val_fraction, cfg.test_fraction, public_size=200)
        client = scenarios.client_data(i, num, cfg)
        assert client.cluster == clusters[i]
        np.testing.assert_array_equal(client.x_train, plain.x_train)
        for got, original in ((client.y_train, plain.y_train), (client.y_test, plain.y_test)):
            np.testing.assert_array_equal(got, perms[clusters[i]][original])


def test_rotate_four_turns_each_cluster_by_exact_quarter_turns():
    cfg, num = _cfg(shift="rotate:4"), 8
    for i in range(num):
        plain = data_lib.embedded_client(i, num, "iid", cfg.seed, cfg.val_fraction, cfg.test_fraction, public_size=200)
        client = scenarios.client_data(i, num, cfg)
        np.testing.assert_array_equal(np.rot90(client.x_test, k=-client.cluster, axes=(2, 3)), plain.x_test)
        np.testing.assert_array_equal(client.y_test, plain.y_test)
    assert {scenarios.client_data(i, num, cfg).cluster for i in range(num)} == {0, 1, 2, 3}
    odd = scenarios.rotate(np.ones((1, 1, 8, 8), np.float32), 45.0)  # not a quarter turn: interpolated
    assert odd.shape == (1, 1, 8, 8) and odd[0, 0, 0, 0] == 0.0 and odd[0, 0, 4, 4] == 1.0


def test_synthetic_clients_follow_fedprox_generator_and_differ_in_size():
    cfg = _cfg(dataset="synthetic:1,1", model="mlp")
    clients = [scenarios.client_data(i, 50, cfg) for i in range(50)]
    sizes = [len(c.x_train) + len(c.x_val) + len(c.x_test) for c in clients]
    assert min(sizes) >= 50 and max(sizes) <= scenarios.MAX_SYNTHETIC_SIZE and len(set(sizes)) > 40
    assert all(c.input_shape == (60,) and c.num_classes == 10 for c in clients)
    assert all(c.y_train.min() >= 0 and c.y_train.max() < 10 for c in clients)
    # Σ_jj = j^−1.2: within a client, feature 1 varies more than feature 60 by a factor ≈ 60^0.6.
    big = max(clients, key=lambda c: len(c.x_train))
    ratio = big.x_train[:, 0].std() / big.x_train[:, -1].std()
    assert 60**0.6 / 2 < ratio < 60**0.6 * 2

    # β spreads the clients' feature means B_k ~ N(0, β²): their mean features drift apart.
    def spread(beta):
        cfg = _cfg(dataset=f"synthetic:1,{beta}")
        return np.std([scenarios.client_data(i, 30, cfg).x_train.mean() for i in range(30)])

    assert spread(10) > 5 * spread(0)
    again = scenarios.client_data(7, 50, cfg)
    np.testing.assert_array_equal(again.x_train, clients[7].x_train)  # seeded


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("shift", "relabel", "shift must be 'none', 'relabel:K' or 'rotate:K'"),
        ("shift", "rotate:0", "shift must be"),
        ("dataset", "synthetic:1", "dataset must be 'digits', 'mnist5k', 'synthetic:ALPHA,BETA'"),
        ("dataset", "cifar", "dataset must be"),
    ],
)
def test_a_wrong_scenario_is_refused_by_name(key, value, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_mapping({key: value})


def test_a_run_records_each_clients_cluster_and_reports_accuracy_per_cluster(tmp_path):
    cfg = _cfg(shift="relabel:2", **{"num-server-rounds": 1, "min-nodes": 4, "results-dir": str(tmp_path)})
    results = run_in_process(cfg, 4)
    clusters = {c["client"]: c["shift_cluster"] for c in results["clients"]}
    assert clusters == {f"partition-{i}": scenarios.cluster_of(i, 4, 2, cfg.seed) for i in range(4)}
    report = (tmp_path / "report.md").read_text()
    assert "Accuracy per cluster of shift `relabel:2`" in report and json.loads((tmp_path / "results.json").read_text())
