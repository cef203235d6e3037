"""Every built-in strategy of the pinned Flower drives florist's ClientApp, in process (no Ray:
`InProcessGrid` answers `Strategy.start`'s calls): each one changes the model, and where a
strategy asks something of its clients (a config key to honour, a metric under its key, a
client mod) the test proves the clients do it. The Ray run of Flower's FedAvg stays in
`test_simulation.py` as the end-to-end one."""

import dataclasses
import gc
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import strategy as flower
from flwr.serverapp.strategy import qfedavg

from florist.apps.client import app
from florist.client.node import Request
from florist.common import client_mods, protocol, scenarios, training
from florist.common.models import seeded_model
from florist.common.settings import NoSettings
from florist.config import RunConfig
from florist.runners.inprocess import InProcessGrid, server_identity
from florist.strategies.fedavg import client as fedavg_client

NODES, PARTITIONS, ROUNDS = 3, 10, 2  # three small partitions of ten: short local epochs
SAMPLE = {"min_available_nodes": NODES, "min_train_nodes": NODES, "min_evaluate_nodes": NODES}
CLIP = 0.5  # well below the size of a local epoch's update, so clipping must act


class Trained(NamedTuple):
    """One client's train exchange as it came back, before any strategy rewrote it."""

    partition: int
    config: dict[str, Any]
    sent: dict[str, np.ndarray]
    metrics: dict[str, float]
    update_norm: float  # ‖w_local − w_sent‖ over all arrays


class RecordingGrid(InProcessGrid):
    """`InProcessGrid` that also keeps every train exchange (some strategies clip or pop the
    replies' arrays while aggregating, so the update norm is taken on arrival)."""

    def __init__(self, node_config: dict | None = None, run_config: dict | None = None):
        configs = [{"partition-id": i, "num-partitions": PARTITIONS} | (node_config or {}) for i in range(NODES)]
        super().__init__(app, configs, run_config=run_config)
        self.trained: list[Trained] = []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = super().send_and_receive(messages, timeout=timeout)
        sent = {m.metadata.message_id: m for m in messages}
        for reply in replies:
            request = sent[reply.metadata.reply_to_message_id]
            if request.metadata.message_type == "train" and not reply.has_error():
                before = {k: a.numpy() for k, a in request.content["arrays"].items()}
                after = {k: a.numpy() for k, a in reply.content["arrays"].items()}
                norm = float(np.sqrt(sum(np.sum((after[k].astype(np.float64) - v) ** 2) for k, v in before.items())))
                partition = self.contexts[request.metadata.dst_node_id].node_config["partition-id"]
                metrics = dict(reply.content["metrics"])
                self.trained.append(Trained(partition, dict(request.content["config"]), before, metrics, norm))
        return replies


@pytest.fixture(autouse=True)
def quick_full_collections():
    """QFedAvg and Bulyan run a full `gc.collect()` per aggregation (Flower's ArrayRecord with
    `keep_input=False`): over a second each with torch, scikit-learn and datasets loaded. Frozen,
    what the process held before a test leaves those collections alone; what it makes is still
    collected."""
    gc.freeze()
    yield
    gc.unfreeze()


def initial_model():
    """The model florist's clients build from the default run config, for the 8×8 digits."""
    cfg = RunConfig()
    return seeded_model(cfg.model, (1, 8, 8), cfg.num_classes, cfg.seed)


def run(strategy, grid: RecordingGrid, rounds: int = ROUNDS):
    """(initial state dict, Flower's Result) of `strategy` driving `grid`'s florist clients."""
    model = initial_model()
    with server_identity(grid.run_id):
        initial = ArrayRecord(model.state_dict())
        result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds, timeout=60)
    return model.state_dict(), result


def updates_within_the_clipping_norm(trained: list[Trained]) -> None:
    """Client-side clipping: no update is longer than the norm the strategy sent, and some
    reach it (so the clients' updates were longer, and the mod cut them)."""
    norms = [(t.update_norm, t.config["clipping_norm"]) for t in trained]
    assert all(norm <= clip * (1 + 1e-5) for norm, clip in norms), norms
    assert any(norm == pytest.approx(clip, rel=1e-4) for norm, clip in norms), norms


def norm_bits_reported(trained: list[Trained]) -> None:
    """Client-side adaptive clipping: clipped, and each reply says whether it was (`norm_bit`)."""
    updates_within_the_clipping_norm(trained)
    assert all(t.metrics["norm_bit"] in (0, 1) for t in trained)


@dataclasses.dataclass
class Case:
    """A strategy of the table: how to build it, where its clients name their mods, its contract."""

    make: Callable[[], Any]
    node_config: dict = dataclasses.field(default_factory=dict)
    run_config: dict = dataclasses.field(default_factory=dict)
    check: Callable[[list[Trained]], None] | None = None  # the client contract, beyond "the model changed"


def fedavg():
    return flower.FedAvg(**SAMPLE)


CASES = {
    "FedAvg": Case(fedavg),
    "FedAvgM": Case(lambda: flower.FedAvgM(**SAMPLE, server_momentum=0.9)),
    "FedProx": Case(lambda: flower.FedProx(**SAMPLE, proximal_mu=1.0)),  # its contract: test_fedprox_...
    "FedAdagrad": Case(lambda: flower.FedAdagrad(**SAMPLE)),
    "FedAdam": Case(lambda: flower.FedAdam(**SAMPLE)),
    "FedYogi": Case(lambda: flower.FedYogi(**SAMPLE)),
    "FedMedian": Case(lambda: flower.FedMedian(**SAMPLE)),
    "FedTrimmedAvg": Case(lambda: flower.FedTrimmedAvg(**SAMPLE, beta=0.34)),  # trims one of three
    "Krum": Case(lambda: flower.Krum(**SAMPLE)),
    "MultiKrum": Case(lambda: flower.MultiKrum(**SAMPLE, num_nodes_to_select=2)),
    "Bulyan": Case(lambda: flower.Bulyan(**SAMPLE)),  # 4f + 3 = 3 replies with f = 0
    "QFedAvg": Case(lambda: flower.QFedAvg(RunConfig().lr, **SAMPLE)),  # its contract: test_qfedavg_...
    "DifferentialPrivacyServerSideFixedClipping": Case(
        lambda: flower.DifferentialPrivacyServerSideFixedClipping(fedavg(), 0.01, CLIP, NODES)
    ),
    "DifferentialPrivacyServerSideAdaptiveClipping": Case(
        lambda: flower.DifferentialPrivacyServerSideAdaptiveClipping(fedavg(), 0.01, NODES)
    ),
    "DifferentialPrivacyClientSideFixedClipping": Case(
        lambda: flower.DifferentialPrivacyClientSideFixedClipping(fedavg(), 0.01, CLIP, NODES),
        node_config={"client-mods": "fixedclipping"},
        check=updates_within_the_clipping_norm,
    ),
    "DifferentialPrivacyClientSideAdaptiveClipping": Case(
        lambda: flower.DifferentialPrivacyClientSideAdaptiveClipping(fedavg(), 0.01, NODES),
        run_config={"client-mods": "adaptiveclipping_mod"},
        check=norm_bits_reported,
    ),
}
OUT_OF_SCOPE = {"FedXgbBagging", "FedXgbCyclic"}  # XGBoost models as bytes, not torch arrays (README)


def test_the_table_covers_every_strategy_flower_ships():
    ships = {name for name in flower.__all__ if name not in ("Strategy", "Result")}
    assert ships == set(CASES) | OUT_OF_SCOPE


@pytest.mark.parametrize("name", CASES)
def test_flowers_strategy_drives_florist_clients(name):
    case = CASES[name]
    grid = RecordingGrid(case.node_config, case.run_config)
    initial, result = run(case.make(), grid)
    assert len(grid.trained) == ROUNDS * NODES  # no error replies
    final = result.arrays.to_numpy_ndarrays()  # float64 from the adaptive optimizers
    assert any(not np.allclose(f, v.numpy()) for f, v in zip(final, initial.values(), strict=True))
    metrics = dict(result.evaluate_metrics_clientapp[ROUNDS]) | dict(result.train_metrics_clientapp[ROUNDS])
    assert np.isfinite(metrics["accuracy"]) and np.isfinite(metrics["train-loss"])
    json.dumps(metrics)  # plain numbers, as Flower's strategies aggregate and log them
    if case.check:
        case.check(grid.trained)


def test_fedprox_mu_keeps_each_local_model_near_the_global_one():
    """FedProx sends `proximal-mu`; florist's clients add μ/2·‖w − w_global‖² to their loss, so
    a large μ shrinks every client's first-round update (same model, same batches)."""
    norms = {}
    for mu in (0.0, 4.0):
        grid = RecordingGrid()
        run(flower.FedProx(**SAMPLE, fraction_evaluate=0.0, proximal_mu=mu), grid, rounds=1)
        assert all(t.config["proximal-mu"] == mu for t in grid.trained)
        norms[mu] = [t.update_norm for t in sorted(grid.trained, key=lambda t: t.partition)]
    assert len(norms[0.0]) == NODES
    assert all(near < 0.5 * far for near, far in zip(norms[4.0], norms[0.0], strict=True)), norms


def test_qfedavg_reads_each_clients_loss_of_the_global_model(monkeypatch):
    """q-FFL weighs a client by F_k(w^t), its loss on its train split under the global model
    it was sent: QFedAvg reads it under `train_loss`, and it is that loss, recomputed here."""
    read = []

    def spy(msg, key):
        read.append(loss := get_train_loss(msg, key))
        return loss

    get_train_loss = qfedavg.get_train_loss
    monkeypatch.setattr(qfedavg, "get_train_loss", spy)
    grid = RecordingGrid()
    run(flower.QFedAvg(client_learning_rate=RunConfig().lr, **SAMPLE, fraction_evaluate=0.0), grid, rounds=2)
    expected = []
    for t in grid.trained:
        model = initial_model()
        model.load_state_dict({k: torch.from_numpy(v) for k, v in t.sent.items()})
        d = scenarios.client_data(t.partition, PARTITIONS, RunConfig())
        expected.append(training.evaluate(model, d.x_train, d.y_train)[0])
    assert len(read) == 2 * NODES
    assert read == pytest.approx(expected, rel=1e-5)
    assert read != pytest.approx([t.metrics["train-loss"] for t in grid.trained], rel=1e-3)  # not the training's


def _train_request(model, config: dict) -> Request:
    return Request(NoSettings(), protocol.content(protocol.to_record(model), config))


def test_florists_own_fedavg_takes_proximal_mu_from_the_run_config(make_node):
    """`proximal-mu` is a run-config key: florist's own FedAvg adds the same proximal term."""
    norms = {}
    for mu in (0.0, 4.0):
        node = make_node({"proximal-mu": mu})
        model = node.new_model()
        sent = {k: v.clone() for k, v in model.state_dict().items()}
        reply = fedavg_client.train(node, _train_request(model, {"strategy": "fedavg"}))
        trained = reply["arrays"].to_torch_state_dict()
        norms[mu] = float(torch.sqrt(sum(((trained[k] - v) ** 2).sum() for k, v in sent.items())))
        assert "train_loss" not in reply["metrics"]  # Flower's strategies' key, not florist's server's
    assert norms[4.0] < 0.5 * norms[0.0]


def test_an_unknown_client_mod_is_a_one_line_error_naming_the_choices():
    """In the run config at start-up; in a node's config, in that node's reply."""
    expected = "unknown client mod {!r} in client-mods; choose from " + ", ".join(client_mods.MODS)
    with pytest.raises(ValueError, match=f"^invalid run config: {expected.format('clip')}$"):
        RunConfig.from_mapping({"client-mods": "fixedclipping, clip"})
    grid = InProcessGrid(app, [{"partition-id": 0, "num-partitions": PARTITIONS, "client-mods": "fixedclip"}])
    [reply] = _send_train(grid, {})
    assert reply.error.reason == "ValueError in train: " + expected.format("fixedclip")


def test_client_mods_named_in_the_message_config_run_too():
    """florist's own server sends `client-mods` with the run's settings; a clipping mod named
    there runs, and refuses a message without a clipping norm as Flower's mod does."""
    grid = InProcessGrid(app, [{"partition-id": 0, "num-partitions": PARTITIONS}])
    [reply] = _send_train(grid, {"client-mods": "fixedclipping"})
    assert "fixedclipping_mod requires the key 'clipping_norm'" in reply.error.reason


def _send_train(grid: InProcessGrid, config: dict) -> list[Message]:
    content = RecordDict({"arrays": ArrayRecord(initial_model().state_dict()), "config": ConfigRecord(config)})
    with server_identity(grid.run_id):
        return grid.send_and_receive([Message(content, dst_node_id=100, message_type="train")])


def test_the_readme_serverapp_runs_fedprox_against_florist_clients():
    """The docs' example (docs/flower-strategies.md), run on the in-process grid instead of Flower's simulation."""
    readme = (Path(__file__).parents[1] / "docs" / "flower-strategies.md").read_text()
    section = readme.split("# Use Flower's own strategies", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict[str, Any] = {"__name__": "readme"}
    exec(compile(code, "docs/flower-strategies.md", "exec"), namespace)
    grid = RecordingGrid()
    context = Context(
        run_id=grid.run_id, node_id=0, node_config={}, state=RecordDict(), run_config={"num-server-rounds": 1}
    )
    with server_identity(grid.run_id):
        namespace["app"](grid, context)
    assert len(grid.trained) == NODES and all(t.config["proximal-mu"] > 0 for t in grid.trained)


def test_a_node_driven_by_flowers_fedavg_keeps_the_model_of_the_last_rounds_evaluation(tmp_path):
    """Flower's strategies evaluate in rounds 1..num_rounds (florist's server once more after):
    the last round's is the final evaluation, whose model a node keeps."""
    from florist.client import personal

    grid = RecordingGrid({"trusted-server": True}, {"num-server-rounds": ROUNDS, "models-root": str(tmp_path)})
    run(fedavg(), grid)
    kept = personal.find(tmp_path, "partition-0")
    assert kept.manifest["round"] == ROUNDS
