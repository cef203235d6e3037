"""A node's own privacy ledger (florist/client/ledger.py) against a server that tries to spend the
node's local-dp budget for it: repeating a round, opening fresh runs that each claim one round,
or sending another strategy's message. Messages go through florist's real ClientApp
(`InProcessGrid`, serialized both ways); the ε each test reports is computed here, with
dp-accounting, from the replies it collected: how many distinct noised models, at the noise std
measured on them."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Message

from florist.apps.client import app
from florist.client import guard
from florist.common import protocol
from florist.common.models import seeded_model
from florist.common.protocol import message_config
from florist.config import RunConfig
from florist.runners.inprocess import InProcessGrid, server_identity
from florist.strategies.fedattn.spec import REPRESENT, TRAIN_ATTN
from florist.strategies.fedavg.spec import TRAIN
from florist.strategies.knnper.spec import EVALUATE_KNNPER
from florist.strategies.pefll.spec import TRAIN_GENERATED
from florist.strategies.perfedckt.spec import TRAIN_CKT

EPSILON, DELTA, CLIP = 1.0, 1e-5, 1.0
# the server's own dp is weaker in every way, and it claims one round, so that its σ would be small
SERVER = {"dp": "local", "dp-epsilon": 50.0, "dp-clip": CLIP, "num-server-rounds": 1, "partition": "iid"}


@pytest.fixture(autouse=True)
def untrusting(monkeypatch):
    monkeypatch.delenv(guard.TRUSTED_SERVER_ENV, raising=False)


@pytest.fixture
def node_config(tmp_path) -> dict:
    """A node that makes its own promise: local dp, ε = 1 over its lifetime (dp-releases: 30)."""
    own = {"dp": "local", "dp-epsilon": EPSILON, "dp-clip": CLIP, "state-dir": str(tmp_path / "state")}
    return {"partition-id": 0, "num-partitions": 20} | own


def ask(grid: InProcessGrid, exchange=TRAIN, server_round: int = 1, config_run_id: int | None = None, **values):
    """One message of the server's `exchange` to the grid's node, the model under `arrays`."""
    cfg = RunConfig.from_mapping(SERVER | values)
    run_id = grid.run_id if config_run_id is None else config_run_id
    content = protocol.content(model(cfg), config=message_config(cfg, exchange, server_round, run_id))
    with server_identity(grid.run_id):
        [reply] = grid.send_and_receive([Message(content, dst_node_id=100, message_type=exchange.message_type)])
    return reply


def model(cfg: RunConfig):
    return protocol.to_record(seeded_model(cfg.model, (1, 8, 8), cfg.num_classes, cfg.seed))


def released_epsilon(replies: list[Message]) -> tuple[float, float, int]:
    """(ε, σ, releases) of the replies as an observer can work them out: the distinct noised
    models, each N(0, σ²C²) per coordinate around the sent model moved by at most C, composed by
    dp-accounting's RDP accountant (its default orders, not florist's)."""
    import dp_accounting
    from dp_accounting import rdp

    sent = np.concatenate([a.numpy().ravel() for a in model(RunConfig.from_mapping(SERVER)).values()])
    got = {}
    for reply in replies:
        assert not reply.has_error(), reply.error.reason
        flat = np.concatenate([a.numpy().ravel() for a in reply.content[protocol.ARRAYS].values()])
        got[hashlib.sha256(flat.tobytes()).hexdigest()] = flat.astype(np.float64) - sent
    sigma = float(np.mean([d.std() for d in got.values()])) / CLIP
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma), len(got)))
    return accountant.get_epsilon(DELTA), sigma, len(got)


def test_a_round_asked_200_times_is_released_once(node_config):
    grid = InProcessGrid(app, [node_config])
    replies = [ask(grid) for _ in range(200)]
    epsilon, _, releases = released_epsilon(replies)
    assert releases == 1 and epsilon <= EPSILON
    assert set(replies[0].content[protocol.METRICS]) == {"num-examples"}  # no train loss: nothing un-noised


def test_20_fresh_runs_claiming_one_round_each_stay_within_the_nodes_lifetime_budget(node_config):
    replies = []
    for i in range(20):  # each a new Flower run (a new context), with a new run-id in its config too
        replies.append(ask(InProcessGrid(app, [node_config]), config_run_id=i))
    epsilon, sigma, releases = released_epsilon(replies)
    assert releases == 20 and epsilon <= EPSILON
    assert sigma == pytest.approx(20.43, rel=0.02)  # the node's own: ε = 1 over its 30 releases (PLD), not 1 round's


def test_the_release_past_the_nodes_own_budget_is_refused_in_one_line(node_config):
    node_config["dp-releases"] = 2
    replies = [ask(InProcessGrid(app, [node_config])) for _ in range(3)]
    assert not any(r.has_error() for r in replies[:2])
    reason = replies[2].error.reason
    assert "\n" not in reason and "another noised release would spend ε = " in reason
    assert "> its dp-epsilon 1 (2 releases in its lifetime" in reason


@pytest.mark.parametrize(
    ("exchange", "strategy"),
    [(TRAIN_ATTN, "fedattn"), (REPRESENT, "fedattn"), (TRAIN_GENERATED, "pefll"), (TRAIN_CKT, "perfed-ckt")],
)
def test_another_strategys_message_under_the_nodes_own_dp_is_refused_naming_its_type(node_config, exchange, strategy):
    reply = ask(
        InProcessGrid(app, [node_config]), exchange, strategy=strategy, dp="none", **{"dp-epsilon": float("inf")}
    )
    assert reply.has_error() and "\n" not in reply.error.reason
    assert f"its own dp = 'local' does not bound a '{exchange.message_type}' reply" in reply.error.reason


def test_a_server_claiming_one_round_cannot_shrink_a_distributed_dp_nodes_sigma(tmp_path, caplog):
    """Under secure aggregation the server sends σ; nodes whose own ε = 1 is sized for their 30
    releases (σ = 20.43, PLD) refuse the 4.x a one-round run asks for, so nothing is released."""
    from florist.apps.server import run

    own = {"dp": "distributed", "dp-epsilon": EPSILON}
    state = {"state-dir": str(tmp_path / "state")}
    grid = InProcessGrid(app, [{"partition-id": i, "num-partitions": 4} | own | state for i in range(4)])
    values = {"secure-aggregation": "secaggplus", "num-server-rounds": 1, "min-nodes": 4, "unseen-fraction": 0.0}
    cfg = RunConfig.from_mapping(own | values | {"results-dir": str(tmp_path / "run")})
    with server_identity(grid.run_id), pytest.raises(RuntimeError, match="0 node"):
        run(grid, cfg, None, grid.run_id)
    refused = [r.getMessage() for r in caplog.records if "left out of train.secagg" in r.getMessage()]
    assert len(refused) == 4 and all("below the 20.43 its dp settings need" in m for m in refused), refused


def test_a_restarted_secure_round_masks_the_same_noised_vector(make_node):
    """dp = "distributed": the noise share of a (run, round) is drawn once; a restart (new keys,
    new masks) gets the same noised vector, not a second draw of the same update."""
    from florist.client import secure

    values = {"dp": "distributed", "dp-noise-multiplier": 2.0, "secure-aggregation": "secaggplus"}
    node = make_node(values, server_round=3)
    vector = np.zeros(1000)  # no tail under dp: every value is the update's
    first, again = (secure.distributed_release(node, vector, 2.0, 3) for _ in range(2))
    assert np.array_equal(first, again) and first.std() == pytest.approx(2.0 / 2**0.5, rel=0.1)
    node.server_round = 4
    assert not np.array_equal(secure.distributed_release(node, vector, 2.0, 3), first)


def test_knnpers_evaluation_under_dp_keeps_what_the_node_chose_on_its_data(node_config):
    """λ, k and σ are chosen on the node's validation split and the store is its data's size:
    under dp they are not noised, so they are not sent; the accuracies are (evaluation replies)."""
    reply = ask(InProcessGrid(app, [node_config]), EVALUATE_KNNPER, strategy="knnper")
    assert not reply.has_error(), reply.error.reason
    metrics = reply.content[protocol.METRICS]
    assert {"accuracy", "global-accuracy"} <= set(metrics) and not {"lambda", "k", "sigma", "datastore-size"} & set(
        metrics
    )


def test_a_repeat_of_a_round_whose_reply_is_no_longer_kept_is_refused_not_drawn_again(make_node):
    from florist.client.ledger import KEPT_REPLIES, Ledger

    own = {"dp": "local", "dp-noise-multiplier": 5.0}
    node = make_node(own, node_config=own)
    for server_round in range(1, KEPT_REPLIES + 2):
        node.server_round = server_round
        Ledger(node).release(lambda plan: {"x": np.full(3, plan.sigma)})
    node.server_round = KEPT_REPLIES + 1
    assert Ledger(node).prior()["x"].tolist() == [5.0] * 3  # the newest are kept
    node.server_round = 1
    with pytest.raises(ValueError, match="round 1 of this run was released already and its noised reply is no longer"):
        Ledger(node).release(lambda plan: {"x": np.zeros(3)})


@pytest.mark.parametrize("node_config", [{}, {"dp": "local", "dp-epsilon": 8, "dp-releases": 20}])
def test_every_release_a_plan_sized_is_answered_and_the_next_refused(make_node, node_config):
    """σ is calibrated by the tighter accountant (PLD over 20 releases at ε = 8); the ledger must
    count by the same, or it refuses releases the plan promised (by RDP's looser count, the 17th)."""
    from florist.client.ledger import Ledger

    node = make_node({"dp": "local", "dp-epsilon": 8, "num-server-rounds": 20}, node_config=node_config)
    for server_round in range(1, 21):
        node.server_round = server_round
        Ledger(node).release(lambda plan: {"x": np.zeros(3)})
    node.server_round = 21
    with pytest.raises(ValueError, match="another noised release would spend"):
        Ledger(node).release(lambda plan: {"x": np.zeros(3)})


def test_the_bound_on_noise_levels_is_the_one_the_docs_promise():
    """The test below shrinks the bound to pass it in a few releases, so it cannot see the bound
    itself: a second `KEPT_SIGMAS = 64` later in the module once raised it unseen."""
    from florist.client import ledger

    docs = (Path(__file__).parents[2] / "docs" / "privacy.md").read_text()
    promised = re.search(r"at most (\d+) noise levels per account", " ".join(docs.split()))
    assert promised and int(promised.group(1)) == ledger.KEPT_SIGMAS


def test_a_server_changing_sigma_every_release_leaves_a_bounded_ledger_that_never_understates_epsilon(
    make_node, monkeypatch
):
    """Under the node's own distributed dp with no finite dp-epsilon, any σ at least the node's is
    taken: a σ a hair larger each release added an entry to the ledger per release, for good."""
    from florist.client import ledger, secure

    monkeypatch.setattr(ledger, "KEPT_SIGMAS", 4)  # the bound, small enough to pass in a few releases
    own = {"dp": "distributed", "dp-noise-multiplier": 2.0}
    node = make_node(own | {"secure-aggregation": "secaggplus"}, node_config=own)
    sent = [2.0 * (1 + i / 100) for i in range(10)]
    for server_round, sigma in enumerate(sent, 1):
        node.server_round = server_round
        secure.distributed_release(node, np.zeros(10), sigma, 3)
    counts = {float(s): n for s, n in ledger.Ledger(node).files.load_json(ledger.BOOK)["spent"]["own"].items()}
    assert len(counts) == 4 and sum(counts.values()) == len(sent) and min(counts) == sent[0]
    assert ledger.epsilon(counts, DELTA) >= ledger.epsilon(dict.fromkeys(sent, 1), DELTA)  # at the smaller σ: more ε
