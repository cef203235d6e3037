"""A node keeps the model it scored with (client/personal.py): by run, whole or not at all,
from the final evaluation on, and found again by key and run."""

import json

import numpy as np
import pytest
import torch

from florist.client import personal
from florist.common import training

FINAL = {"num-server-rounds": 2}


def scored(node):
    """The node's final-evaluation reply, which keeps its model; returns the model scored."""
    model = node.new_model()
    reply = node.test_reply(model)
    return model, reply.metric_records["metrics"]["accuracy"]


def test_the_kept_model_is_the_scored_one_and_its_manifest_says_what_it_is(make_node, tmp_path):
    node = make_node(FINAL, run_id=7, server_round=3)
    model, accuracy = scored(node)
    kept = personal.find(tmp_path / "state", node.key)
    assert kept.folder == tmp_path / "state" / node.key / "models" / "7"
    manifest = kept.manifest
    assert (manifest["strategy"], manifest["run_id"], manifest["round"], manifest["node_key"]) == (
        "fedavg",
        7,
        3,
        node.key,
    )
    assert (manifest["model"], manifest["num_classes"], tuple(manifest["input_shape"])) == ("cnn", 10, (1, 8, 8))
    assert manifest["accuracy"] == accuracy and manifest["num_test"] == len(node.data.x_test)
    again = training.predict_proba(kept.network(), node.data.x_test)
    assert np.array_equal(again, training.predict_proba(model, node.data.x_test))
    assert json.loads((kept.folder / personal.MANIFEST).read_text())["run_config"]["num-server-rounds"] == 2


def test_runs_keep_their_own_models_and_the_latest_is_found_by_default(make_node, tmp_path):
    first, second = make_node(FINAL, run_id=1, server_round=3), make_node(FINAL | {"seed": 5}, run_id=2, server_round=3)
    scored(first)
    scored(second)
    root = tmp_path / "state"
    assert [k.manifest["run_id"] for k in personal.kept_models(root, first.key)] == [1, 2]
    assert personal.find(root, first.key).manifest["run_id"] == 2
    older = personal.find(root, first.key, run_id=1).network().state_dict()
    assert not torch.equal(older["head.weight"], personal.find(root, first.key).network().state_dict()["head.weight"])
    with pytest.raises(FileNotFoundError, match=r"kept no model of run 9 .*runs kept: 1, 2"):
        personal.find(root, first.key, run_id=9)


def test_nothing_is_kept_before_the_last_round_or_with_keep_models_off(make_node, tmp_path):
    scored(make_node(FINAL, server_round=1))  # an eval-every evaluation mid-run
    scored(make_node(FINAL | {"keep-models": False}, server_round=3))
    with pytest.raises(FileNotFoundError, match="keeps no model in .*a run's final evaluation keeps one"):
        personal.find(tmp_path / "state", "partition-4")


def test_a_folder_without_its_manifest_is_not_a_model(make_node, tmp_path):
    node = make_node(FINAL, run_id=3, server_round=3)
    scored(node)
    kept = personal.find(tmp_path / "state", node.key)
    (kept.folder / personal.MANIFEST).unlink()  # as while a new version is written
    assert personal.kept_models(tmp_path / "state", node.key) == []
    with pytest.raises(FileNotFoundError, match=f"{kept.folder}: no manifest.json"):
        personal.find(tmp_path / "state", node.key, run_id=3)
    (kept.folder / personal.MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match="manifest.json: unreadable"):
        personal.Kept.read(kept.folder)
