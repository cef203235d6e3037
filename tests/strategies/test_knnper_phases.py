"""kNN-Per's `knn-train-on-val`: phase 2 trains on train + validation, and a seen node scores
the end with the (λ, k, σ) it chose on validation with phase 1's final model."""

import dataclasses

import numpy as np
import pytest
import torch

from florist.client.node import Request
from florist.common import protocol, training
from florist.common.settings import NoSettings
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.strategies.knnper import client as knnper

PHASED = {"strategy": "knnper", "knn-train-on-val": True, "num-server-rounds": 4, "knn-ks": "3,5"}


def request(model, side=None) -> Request:
    side_record = None if side is None else protocol.to_record(side)
    return Request(NoSettings(), protocol.content(protocol.to_record(model), {"strategy": "knnper"}, side=side_record))


@pytest.mark.parametrize(("server_round", "phased", "with_val"), [(2, True, False), (3, True, True), (3, False, False)])
def test_phase_two_trains_on_the_validation_split(make_node, monkeypatch, server_round, phased, with_val):
    seen = []
    real = training.train
    monkeypatch.setattr(training, "train", lambda model, x, y, **kw: seen.append((x, y)) or real(model, x, y, **kw))
    node = make_node(PHASED | {"knn-train-on-val": phased}, server_round=server_round)
    d = node.data
    reply = knnper.train(node, request(node.new_model()))
    ((x, y),) = seen
    found = ((d.x_val.reshape(len(d.x_val), 1, -1) == x.reshape(1, len(x), -1)).all(-1)).any(1)
    assert found.all() == with_val and found.any() == with_val  # every validation sample, or none
    assert len(x) == len(d.x_train) + with_val * len(d.x_val) == reply.metric_records["metrics"]["num-examples"]
    if with_val:
        assert set(map(tuple, np.c_[x.reshape(len(x), -1), y].tolist())) >= set(
            map(tuple, np.c_[d.x_val.reshape(len(d.x_val), -1), d.y_val].tolist())
        )  # with their own labels


def trained_pair(node):
    """Two different global models: phase 1's (A) and phase 2's (B)."""
    a, b = node.new_model(), node.new_model()
    node.fit(a, epochs=2)
    node.fit(b, epochs=1, salt=7)
    return a, b


def test_the_end_uses_the_choice_made_with_phase_ones_model(make_node):
    node = make_node(PHASED, server_round=5)
    a, b = trained_pair(node)
    reply = knnper.evaluate(node, request(b, side=a)).metric_records["metrics"]
    store_a = knnper.datastore_for(dataclasses.replace(node, state=make_node(PHASED, key="other").state), a, "a")
    want = knnper.choose(node, a, store_a)  # independently: on validation, A's train store
    assert (reply["lambda"], reply["k"], reply["sigma"]) == (want.lam, want.k, want.sigma)
    assert reply["phase-one-choice"] == 1
    assert reply["datastore-size"] == len(node.data.x_train) + len(node.data.x_val)  # scored with train + val
    scored = knnper.personalize(node, b, knnper.datastore_for(node, b, "b"), choice=want)
    assert reply["accuracy"] == pytest.approx(float((scored.mixed.argmax(1) == node.data.y_test).mean()))


def test_the_kept_choice_is_read_back_not_made_again(make_node, monkeypatch):
    node = make_node(PHASED, server_round=5)
    a, b = trained_pair(node)
    first = knnper.evaluate(node, request(b, side=a)).metric_records["metrics"]
    monkeypatch.setattr(knnper, "choose", lambda *args, **kw: pytest.fail("chose again"))
    again = knnper.evaluate(dataclasses.replace(node, server_round=6), request(b, side=a))
    assert again.metric_records["metrics"]["lambda"] == first["lambda"]
    b_trained_more = node.new_model()  # another phase-1 model: the kept choice is not its
    with pytest.raises(pytest.fail.Exception, match="chose again"):
        knnper.evaluate(node, request(b, side=b_trained_more))


def test_unseen_nodes_choose_with_the_current_model_and_seen_ones_need_phase_ones(make_node):
    unseen = make_node(PHASED, server_round=5, seen=False)
    a, b = trained_pair(unseen)
    reply = knnper.evaluate(unseen, request(b)).metric_records["metrics"]
    want = knnper.choose(unseen, b, knnper.datastore_for(unseen, b, "b"))
    assert (reply["lambda"], reply["k"], reply["sigma"], reply["phase-one-choice"]) == (want.lam, want.k, want.sigma, 0)
    with pytest.raises(protocol.ProtocolError, match="phase 1's model"):
        knnper.evaluate(make_node(PHASED, server_round=5), request(b))


class Stop(Exception):
    pass


def test_a_phased_run_keeps_phase_ones_model_and_resumes_in_phase_two(tmp_path):
    """A whole run, and one stopped after round 3 (phase 2) and resumed from its checkpoint:
    the same final scores, every seen node on its phase-1 choice, unseen ones on their own."""
    values = PHASED | {"min-nodes": 5, "eval-every": 2, "knn-sigmas": "1,3"}
    whole = run_in_process(RunConfig.from_mapping(values | {"results-dir": str(tmp_path / "whole")}), 5)
    seen = [c for c in whole["clients"] if c["seen"]]
    assert seen and all(c["phase_one_choice"] == 1 for c in seen)
    assert all(c["phase_one_choice"] == 0 for c in whole["clients"] if not c["seen"])
    state = torch.load(tmp_path / "whole" / "checkpoint.pt")["state"]
    assert set(state) == {"model", "chooser"}
    assert any(not torch.equal(state["model"][k], state["chooser"][k]) for k in state["model"])

    def stop_after_three(row):
        if row["round"] == 3:
            raise Stop

    cut = RunConfig.from_mapping(values | {"results-dir": str(tmp_path / "cut")})
    with pytest.raises(Stop):
        run_in_process(cut, 5, on_round=stop_after_three)
    resumed = run_in_process(cut.replace(resume_from=str(tmp_path / "cut")), 5)
    assert resumed["clients"] == whole["clients"]
