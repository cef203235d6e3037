import numpy as np
import pytest

from florist.client.state import NodeState


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
