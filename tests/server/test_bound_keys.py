"""`bind-node-keys`: a node key belongs to the SuperNode that first claimed it (its Flower node
id, which under SuperNode auth stands for its registered public key), and a resumed run keeps
the binding, so another SuperNode cannot stand in for a node by naming its key. (Real
SuperLink + SuperNodes with TLS and auth: tests/deploy/test_bound_keys_deployed.py.)"""

import pytest
import torch

from florist.apps.client import app as client_app
from florist.apps.server import run
from florist.config import RunConfig
from florist.runners.inprocess import InProcessGrid, server_identity
from florist.server.checkpoint import FILE, VERSION, Checkpoint
from florist.server.exchange import Exchanger
from florist.server.loop import bind, discover

NODES = [{"partition-id": i, "num-partitions": 3} for i in range(3)]  # node ids 100, 101, 102
SWAPPED = [NODES[0] | {"node-key": "partition-1"}, NODES[1] | {"node-key": "partition-0"}, NODES[2]]


def _cfg(tmp_path, bind: bool) -> RunConfig:
    return RunConfig.from_mapping(
        {
            "strategy": "fedavg",
            "model": "mlp",
            "num-server-rounds": 1,
            "min-nodes": 3,
            "partition": "iid",
            "unseen-fraction": 0.0,
            "bind-node-keys": bind,
            "results-dir": str(tmp_path / "run"),
        }
    )


def _run(cfg: RunConfig, nodes: list[dict]) -> None:
    grid = InProcessGrid(client_app, nodes)
    with server_identity(grid.run_id):
        run(grid, cfg, lambda row: None, grid.run_id)


@pytest.mark.parametrize("bind", [False, True])
def test_at_resume_supernodes_that_swap_keys_stand_in_for_each_other_only_when_keys_are_not_bound(tmp_path, bind):
    cfg = _cfg(tmp_path, bind)
    _run(cfg, NODES)
    saved = Checkpoint.load(cfg.results_dir)
    assert saved.bindings == ({"partition-0": 100, "partition-1": 101, "partition-2": 102} if bind else {})
    resumed = cfg.replace(resume_from=cfg.results_dir)
    if not bind:  # the old behaviour, still the default: a key is whatever the node says
        _run(resumed, SWAPPED)
        return
    with pytest.raises(ValueError, match=r"node\(s\) partition-0, partition-1 of the run did not connect"):
        _run(resumed, SWAPPED)


def test_discover_refuses_a_bound_key_to_another_supernode_and_the_nodes_kept_bind_new_keys():
    grid = InProcessGrid(client_app, SWAPPED)
    cfg = RunConfig.from_mapping({"partition": "iid", "unseen-fraction": 0.0})
    bound = {"partition-0": 100, "partition-1": 101}
    with server_identity(grid.run_id):
        exchanger = Exchanger(grid, 60.0, grid.run_id)
        nodes = discover(exchanger, cfg, [100, 101, 102], bound=bound)
    assert [n.key for n in nodes] == ["partition-2"] and len(bound) == 2  # the caller binds what it keeps
    bind(bound, nodes)
    assert bound == {"partition-0": 100, "partition-1": 101, "partition-2": 102}
    reasons = {f["node"]: f["reason"] for f in exchanger.failures}
    assert reasons == {
        "node 100": "node key 'partition-1' is bound to SuperNode 101",
        "node 101": "node key 'partition-0' is bound to SuperNode 100",
    }


def test_a_checkpoint_with_garbled_bindings_is_one_line(tmp_path):
    saved = {"version": VERSION, "round": 1, "config": {}, "run_id": 1, "nodes": [], "state": {}, "failures": []}
    torch.save(saved | {"rounds": [], "bindings": {"partition-0": "100"}}, tmp_path / FILE)
    with pytest.raises(ValueError, match=r"the checkpoint lacks or garbles bindings$"):
        Checkpoint.load(tmp_path)
    torch.save(saved | {"rounds": []}, tmp_path / FILE)  # written before keys could be bound
    assert Checkpoint.load(tmp_path).bindings == {}
