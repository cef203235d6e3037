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


def test_nothing_is_kept_before_the_final_evaluation_or_with_keep_models_off(make_node, tmp_path):
    scored(make_node(FINAL, server_round=1))  # an eval-every evaluation mid-run
    scored(make_node(FINAL, server_round=2))  # the last round's own (eval-every 1): the final one comes next
    scored(make_node(FINAL | {"keep-models": 0}, server_round=3))
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


def test_models_root_places_them_but_only_a_node_that_trusts_its_server_takes_the_servers(monkeypatch):
    from florist.client import guard

    monkeypatch.delenv(guard.TRUSTED_SERVER_ENV, raising=False)
    sent = {"models-root": "/srv/theirs"}
    assert guard.own_paths(sent, {}, "node a")["models-root"] == ""  # a box keeps them in its state folder
    assert guard.own_paths(sent, {"models-root": "/mine"}, "node a")["models-root"] == "/mine"
    assert guard.own_paths(sent, {guard.TRUSTED_SERVER: True}, "node a")["models-root"] == "/srv/theirs"


def test_simulate_keeps_every_clients_model_beside_its_results(tmp_path, capsys):
    from florist.cli import main

    out = tmp_path / "run"
    args = ["simulate", "--runtime", "in-process", "--num-clients", "3", "--rounds", "1", "--results-dir", str(out)]
    assert main([*args, "--unseen-fraction", "0.34"]) == 0
    results = json.loads((out / "results.json").read_text())
    for client in results["clients"]:
        kept = personal.find(out / "nodes", client["client"])
        assert kept.manifest["run_id"] == results["run_id"] and kept.manifest["accuracy"] == client["accuracy"]
    capsys.readouterr()
    assert main(["predict", "--state-dir", str(out / "nodes"), "--node-key", "partition-2", "--split", "test"]) == 0
    [client] = [c for c in results["clients"] if c["client"] == "partition-2"]
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"accuracy: {client['accuracy']:.4f} (")
