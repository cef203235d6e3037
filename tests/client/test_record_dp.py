"""Record-level dp (`dp = "record"`: DP-SGD on every node, docs/privacy.md "Record-level dp"): the ε a
node reports is dp-accounting's for the steps and the sampling rate it took, worked out here on
their own; a record's gradient is clipped, so one outlier moves the model by at most lr·C over the
expected batch; the node's ledger stops it before the step that would pass its dp-epsilon; and
what it does not cover is refused in one line. Messages go through florist's real ClientApp
(`InProcessGrid`)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Message

from florist.apps.client import app
from florist.apps.registry import STRATEGIES
from florist.client import guard
from florist.common import protocol, training
from florist.common.models import seeded_model
from florist.common.protocol import message_config
from florist.config import RunConfig
from florist.runners.inprocess import InProcessGrid, server_identity
from florist.strategies.fedattn.spec import TRAIN_ATTN
from florist.strategies.fedavg.spec import TRAIN
from florist.strategies.pefll.spec import TRAIN_GENERATED

DELTA, BATCH = 1e-5, 16
SERVER = {"dp": "record", "dp-epsilon": 8.0, "num-server-rounds": 3, "batch-size": BATCH, "partition": "iid"}


@pytest.fixture(autouse=True)
def untrusting(monkeypatch):
    monkeypatch.delenv(guard.TRUSTED_SERVER_ENV, raising=False)


@pytest.fixture
def node_config(tmp_path) -> dict:
    return {"partition-id": 0, "num-partitions": 4, "state-dir": str(tmp_path / "state")}


def ask(grid: InProcessGrid, exchange=TRAIN, server_round: int = 1, server: dict = SERVER, **values) -> Message:
    cfg = RunConfig.from_mapping(server | values)
    sent = protocol.to_record(seeded_model(cfg.model, (1, 8, 8), cfg.num_classes, cfg.seed))
    content = protocol.content(sent, config=message_config(cfg, exchange, server_round, grid.run_id))
    with server_identity(grid.run_id):
        [reply] = grid.send_and_receive([Message(content, dst_node_id=100, message_type=exchange.message_type)])
    return reply


def accounted(q: float, sigma: float, steps: int) -> dict[str, float]:
    """ε of `steps` Poisson-subsampled Gaussian steps at (q, σ), by dp-accounting's own accountants:
    PLD at florist's discretization (1e-3, pessimistic) and RDP at the library's default orders."""
    import dp_accounting
    from dp_accounting import pld, rdp

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    out = {}
    for name, accountant in (
        ("pld", pld.PLDAccountant(value_discretization_interval=1e-3)),
        ("rdp", rdp.RdpAccountant()),
    ):
        accountant.compose(event)
        out[name] = accountant.get_epsilon(DELTA)
    return out


def test_the_epsilon_a_node_reports_is_dp_accountings_for_the_steps_and_rate_it_took(node_config):
    grid = InProcessGrid(app, [node_config])
    said, total = [], 0
    for server_round in (1, 2, 3):
        reply = ask(grid, server_round=server_round)
        assert not reply.has_error(), reply.error.reason
        n = int(reply.content[protocol.METRICS]["num-examples"])
        assert set(reply.content[protocol.METRICS]) == {"num-examples"}  # no train loss: un-noised
        record = dict(reply.content.config_records[protocol.RECORD_DP])
        assert record["q"] == pytest.approx(BATCH / n)  # the Poisson rate of its own train split
        assert record["steps"] == math.ceil(n / BATCH)  # a round: one epoch's worth of expected batches
        total += record["steps"]
        expected = accounted(record["q"], record["sigma"], total)
        # the tighter of the two bounds, as florist reports it (its RDP orders differ from the default)
        assert record["epsilon"] == pytest.approx(min(expected.values()), rel=2e-3)
        said.append(record["epsilon"])
    assert said[0] < said[1] < said[2] <= 8.0
    assert said[2] == pytest.approx(8.0, rel=1e-3)  # σ calibrated to spend dp-epsilon over the run's steps


def test_one_records_huge_loss_moves_the_model_by_at_most_lr_times_its_clip_over_the_batch():
    """Noise 0, every record each step (q = 1): the model trained with an outlier (a record scaled
    10⁴, its label wrong) and without it differ by at most lr·C/b after one step, b the expected
    batch: its gradient, clipped to C, is one of the sum's terms. Plain SGD lets it move far more."""
    rng = np.random.default_rng(0)
    x = rng.random((8, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 8)
    outlier_x = np.concatenate([x, 1e4 * np.ones((1, 1, 8, 8), np.float32)])
    outlier_y = np.concatenate([y, [(int(y[0]) + 1) % 10]])
    lr, clip, batch = 0.5, 1.0, 8

    def trained(xs, ys, private: bool) -> torch.Tensor:
        model = seeded_model("cnn", (1, 8, 8), 10, 1)
        if private:
            generator = torch.Generator().manual_seed(0)
            settings = {"rate": 1.0, "clip": clip, "sigma": 0.0, "sampler": generator}
            training.train_private(model, xs, ys, steps=1, batch_size=batch, lr=lr, **settings)
        else:
            training.train(model, xs, ys, steps=1, batch_size=len(xs), lr=lr)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    moved = float((trained(outlier_x, outlier_y, True) - trained(x, y, True)).norm())
    assert 0 < moved <= lr * clip / batch * (1 + 1e-4)
    assert float((trained(outlier_x, outlier_y, False) - trained(x, y, False)).norm()) > 100 * lr * clip / batch


@pytest.mark.parametrize("name", ["cnn", "lenet", "mlp"])
def test_per_sample_gradients_are_torch_funcs(name):
    """florist's per-sample gradients (layer hooks) equal torch.func's vmap(grad) on each model dp takes."""
    from torch.func import functional_call, grad, vmap

    shape = (1, 28, 28) if name == "lenet" else (1, 8, 8)
    model = seeded_model(name, shape, 10, 1)
    x, y = torch.rand(5, *shape, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 3, 3, 9, 1])
    mine, _ = training.per_sample_gradients(model, training.per_sample_layers(model), x, y)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return torch.nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    theirs = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for key, p in model.named_parameters():
        assert torch.allclose(mine[p], theirs[key].reshape(5, -1), atol=1e-5), key


@pytest.mark.parametrize("name", ["cnn", "lenet", "mlp"])
def test_the_clipped_sum_is_the_sum_of_each_samples_clipped_gradient(name):
    """DP-SGD's step takes Σᵢ min(1, C/‖gᵢ‖)·gᵢ without a Linear's per-sample weight gradients (‖gᵢaᵢᵀ‖ =
    ‖gᵢ‖‖aᵢ‖); it must equal clipping each materialized per-sample gradient, at a C that clips some samples
    and not others."""
    shape = (1, 28, 28) if name == "lenet" else (1, 8, 8) if name == "cnn" else (64,)
    model = seeded_model(name, shape, 10, 1)
    x, y = torch.rand(6, *shape, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 3, 3, 9, 1, 7])
    layers = training.per_sample_layers(model)
    rows, losses = training.per_sample_gradients(model, layers, x, y)
    norms = torch.sqrt(sum(r.square().sum(1) for r in rows.values()))
    clip = float(norms.median())
    assert (norms > clip).any() and (norms < clip).any()
    factors = training.clip_factors(list(rows.values()), clip)
    summed, same_losses = training.clipped_sum(model, layers, x, y, clip)
    assert torch.equal(losses, same_losses)
    for p in model.parameters():
        assert torch.allclose(summed[p], (factors @ rows[p]).view(p.shape), atol=1e-6)


def test_the_ledger_stops_a_node_before_the_step_that_would_pass_its_epsilon(node_config):
    """A node's own promise (σ 1.5, dp-epsilon 2, its --node-config): it trains whole rounds while they fit,
    then fewer steps, then refuses in one line; what it said never passes 2, and one more step would have."""
    node_config |= {"dp": "record", "dp-noise-multiplier": 1.5, "dp-epsilon": 2.0}
    grid = InProcessGrid(app, [node_config])
    steps, said = [], []
    for server_round in range(1, 40):
        reply = ask(grid, server_round=server_round, **{"dp-epsilon": 50.0})  # the server's weaker one is ignored
        if reply.has_error():
            break
        record = dict(reply.content.config_records[protocol.RECORD_DP])
        steps.append(int(record["steps"]))
        said.append(record["epsilon"])
    reason = reply.error.reason
    assert "\n" not in reason and "dp = record: another DP-SGD step would spend ε = " in reason, reason
    assert "> its dp-epsilon 2 (" in reason and "it trains no more" in reason
    assert len(steps) > 2 and len(set(steps[:-1])) == 1 and 0 < steps[-1] < steps[0]  # the last: fewer steps
    assert max(said) <= 2.0 and said == sorted(said)
    assert min(accounted(record["q"], 1.5, sum(steps)).values()) <= 2.0 * (1 + 1e-3)
    assert min(accounted(record["q"], 1.5, sum(steps) + 1).values()) > 2.0  # one more step would have passed it


def test_a_node_under_record_dp_refuses_what_dp_sgd_does_not_bound(node_config):
    """PeFLL's messages carry a descriptor and a gradient of the data that no DP-SGD step bounds: a node whose own
    dp is record-level refuses a PeFLL run (its spec's reason), and a message type of PeFLL's under any strategy."""
    server = {key: value for key, value in SERVER.items() if not key.startswith("dp")}
    own = node_config | {"dp": "record", "dp-epsilon": 8.0}
    reply = ask(InProcessGrid(app, [own]), TRAIN_GENERATED, server=server, strategy="pefll")
    assert reply.has_error() and "\n" not in reply.error.reason
    assert "strategy 'pefll' is not covered by record-level dp" in reply.error.reason
    reply = ask(InProcessGrid(app, [node_config]), TRAIN_GENERATED, strategy="fedavg")
    assert reply.has_error() and "\n" not in reply.error.reason
    assert "record-level dp = 'record' does not bound a 'train.generated' reply" in reply.error.reason


def test_fedattns_representation_and_bias_gradient_are_steps_of_its_ledger(node_config):
    """Under record-level dp a FedAttn round reserves its local steps and one step each for Z and ∂L/∂M̃."""
    reply = ask(InProcessGrid(app, [node_config]), TRAIN_ATTN, strategy="fedattn")
    assert not reply.has_error(), reply.error.reason
    n = int(reply.content[protocol.METRICS]["num-examples"])
    assert reply.content.config_records[protocol.RECORD_DP]["steps"] == math.ceil(n / BATCH) + 2


REFUSED = {
    "pefll": (["--strategy", "pefll", "--run-config", 'dp="record" dp-epsilon=8'], "is not covered by record-level"),
    "odpfl": (["--strategy", "odpfl", "--run-config", 'dp="record" dp-epsilon=8'], "is not covered by record-level"),
    "mobilenet": (['dp="record" dp-epsilon=8 model="mobilenet_v2"'], "BatchNorm mixes the samples"),
    "user keys alone": (['dp="record" dp-epsilon=8 dp-user-epsilon=3'], 'act only under dp = "record+central"'),
    "user budget missing": (['dp="record+central" dp-epsilon=8'], "needs dp-user-epsilon"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_what_record_dp_does_not_cover_is_one_line_and_exit_2(case, refuses_in_one_line):
    args, expected = REFUSED[case]
    refuses_in_one_line(args if args[0] == "--strategy" else ["--run-config", *args], expected)


@pytest.mark.parametrize("name", STRATEGIES)
def test_which_strategies_record_dp_covers_their_specs_say_as_the_run_config_is_parsed(name):
    """One source: a strategy's spec (`record_covered`, `record_gap`); the run config refuses the others as it is
    parsed (no torch, no server half), with the spec's reason."""
    values = {"strategy": name, "dp": "record", "dp-epsilon": 8.0}
    spec = STRATEGIES[name]
    if spec.record_covered:
        assert RunConfig.from_mapping(values).record_refusal() == ""
        return
    with pytest.raises(ValueError, match="is not covered by record-level dp") as refused:
        RunConfig.from_mapping(values)
    assert spec.record_gap in str(refused.value) and "\n" not in str(refused.value)


REFUSAL = """import sys
from florist.cli import main
code = main(sys.argv[1:])
print("torch" in sys.modules)
raise SystemExit(code)
"""


@pytest.mark.parametrize("command, strategy", [("simulate", "pefll"), ("deploy-local", "odpfl")])
def test_an_uncovered_strategy_is_refused_before_torch_is_imported(command, strategy, tmp_path):
    """The refusal needs no second: a fresh `florist` process exits 2 in one line with torch never imported
    (a run's preflight imports it, 5-6 s of a refusal before)."""
    root = Path(__file__).resolve().parents[2]
    args = [command, "--strategy", strategy, "--run-config", 'dp="record" dp-epsilon=8', "--results-dir", str(tmp_path)]
    done = subprocess.run([sys.executable, "-c", REFUSAL, *args], cwd=root, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "is not covered by record-level dp" in lines[0], done.stderr
    assert done.stdout.strip() == "False", "torch was imported before the refusal"


def test_record_dp_takes_a_robust_rule_and_clip_norm_where_user_level_dp_does_not():
    cfg = RunConfig.from_mapping({"dp": "record", "dp-epsilon": 8.0, "aggregation": "median", "clip-norm": 2.0})
    assert cfg.record_dp and cfg.user_dp == "none" and cfg.user_level().dp == "none"
    both = RunConfig.from_mapping({"dp": "record+central", "dp-epsilon": 8.0, "dp-user-epsilon": 3.0})
    user = both.user_level()
    assert (user.dp, user.dp_epsilon, user.dp_clip) == ("central", 3.0, 1.0) and both.dp_epsilon == 8.0


def test_record_dp_under_central_dp_and_secure_aggregation_reports_both_epsilons(tmp_path, capsys):
    """`dp = "record+central"` with secure aggregation: each node's DP-SGD ε (its own ledger) and the run's
    user-level ε (the server's), both in the rows, the clients' rows, the console and report.md."""
    import json

    from florist.cli import main

    out = tmp_path / "run"
    args = ["simulate", "--runtime", "in-process", "--strategy", "knnper", "--num-clients", "4", "--rounds", "2"]
    settings = 'dp="record+central" dp-epsilon=8 dp-user-epsilon=3 secure-aggregation="secaggplus"'
    assert main([*args, "--run-config", settings, "--results-dir", str(out)]) == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    last = results["rounds"][-1]
    assert last["dp_epsilon"] == pytest.approx(3, rel=1e-3) and last["dp_relation"] == "add/remove"
    assert last["dp_record_epsilon"] == pytest.approx(8, rel=1e-3) and len(last["dp_record_nodes"]) == 3
    assert all(n["epsilon"] <= 8 for n in last["dp_record_nodes"].values())
    trained = [c["dp_record_epsilon"] for c in results["clients"] if c["seen"]]
    assert len(trained) == 3 and all(e == pytest.approx(8, rel=1e-3) for e in trained)
    printed = " ".join(capsys.readouterr().err.split())
    report = (out / "report.md").read_text()
    for text in (printed, " ".join(report.split())):
        assert "Differential privacy central (on top of record-level dp)" in text.replace("`", "")
        assert "Record-level differential privacy (DP-SGD on every node" in text and "ε per node: partition-" in text
