import os
import time

import numpy as np
import pytest

from florist.client.state import ACTIVE_SECONDS, NodeState


def test_arrays_and_json_survive_a_new_instance(tmp_path):
    NodeState(tmp_path, "partition-3").save_arrays("index.npz", {"labels": np.arange(4)})
    NodeState(tmp_path, "partition-3").save_json("meta.json", {"version": 2})
    again = NodeState(tmp_path, "partition-3")
    assert (again.load_arrays("index.npz")["labels"] == np.arange(4)).all()
    assert again.load_json("meta.json") == {"version": 2}
    assert again.load_json("absent.json") is None
    assert not list(again.folder.glob(".*"))  # no temporary files left behind


def test_default_root_is_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert NodeState(None, "box-1").folder == tmp_path / "florist" / "nodes" / "box-1"


def test_bad_key_and_corrupt_file_are_explained(tmp_path):
    with pytest.raises(ValueError, match="node key '../etc'"):
        NodeState(tmp_path, "../etc")
    state = NodeState(tmp_path, "n1")
    state.folder.mkdir(parents=True)
    state.path("meta.json").write_text("{broken")
    with pytest.raises(ValueError, match="meta.json is not valid JSON"):
        state.load_json("meta.json")


def test_one_naming_rule_for_run_memory_and_files(tmp_path):
    import torch
    from flwr.app import RecordDict

    memory = RecordDict()
    state = NodeState(tmp_path, "n1", "pefll", memory)
    assert state.recall("encoder") is None
    state.remember("encoder", {"w": torch.ones(2)}, server_round=3)
    arrays, values = NodeState(tmp_path, "n1", "pefll", memory).recall("encoder")  # the next message, same run
    assert torch.equal(arrays["w"], torch.ones(2)) and values == {"server_round": 3}
    assert "pefll/encoder" in memory.array_records
    assert NodeState(tmp_path, "n1", "odpfl", memory).recall("encoder") is None  # another algorithm's name
    assert state.save_arrays("model.npz", {"w": np.ones(2)}) == tmp_path / "n1" / "pefll" / "model.npz"


def test_round_state_is_read_as_of_a_round_so_a_resumed_run_never_sees_its_abandoned_future(tmp_path):
    state = NodeState(tmp_path, "n1", "local")
    for server_round in (1, 2, 3):  # the server checkpointed round 2 and died during round 3
        state.save_round("model", {"w": np.full(2, server_round)}, 7, server_round, rounds=server_round)
    arrays, meta = state.load_round("model", 7, 2)  # the resumed round 3 starts from round 2's
    assert arrays["w"].tolist() == [2, 2] and meta == {"rounds": 2}
    assert state.load_round("model", 8, 3) is None  # another run
    state.save_round("model", {"w": np.full(2, 30)}, 7, 3)  # round 3 again: the abandoned one is replaced
    assert state.load_round("model", 7, 3)[0]["w"].tolist() == [30, 30]
    assert state.load_round("model", 7, 2)[0]["w"].tolist() == [2, 2]  # kept: the server may die again
    assert state.load_round("model", 7, 1) is None  # older versions go
    state.save_round("model", {"w": np.zeros(2)}, 7, 2)  # resumed from round 1: rounds 2 and 3 were never
    assert sorted(p.name for p in state.path("").glob("model-*")) == ["model-7-2.npz"]


def _age(state: NodeState, run: int, seconds: float) -> None:
    for path in state.path("").glob(f"model-{run}-*"):
        os.utime(path, (time.time() - seconds,) * 2)


def test_a_node_keeps_round_state_of_the_last_other_runs_only(tmp_path):
    state = NodeState(tmp_path, "n1", "local")
    for run in range(1, 5):
        state.save_round("model", {"w": np.zeros(1)}, run, 1)
        _age(state, run, 2 * ACTIVE_SECONDS - run)  # finished long ago, in this order
    state.save_round("model", {"w": np.zeros(1)}, 5, 1)
    assert sorted(p.name for p in state.path("").glob("model-*")) == ["model-3-1.npz", "model-4-1.npz", "model-5-1.npz"]


def test_runs_that_saved_lately_are_kept_however_many_they_are(tmp_path):
    """Runs that share a node's folder at the same time (several compares on one machine) must
    not delete each other's models: a node that lost its model would be scored with a fresh one."""
    state = NodeState(tmp_path, "n1", "perfedckt")
    for run in range(1, 6):
        state.save_round("model", {"w": np.full(1, run)}, run, 1)
    _age(state, 1, 2 * ACTIVE_SECONDS)
    state.save_round("model", {"w": np.zeros(1)}, 6, 1)
    assert all(state.load_round("model", run, 1) is not None for run in range(2, 7))
    assert state.load_round("model", 1, 1) is None  # old, and not among the last OTHER_RUNS
