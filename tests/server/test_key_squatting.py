"""A node that reports another's key takes it from no one: a key claimed twice and bound to
neither claimer goes to neither, named with both node ids, at discovery as in the serve phase;
with `bind-node-keys` the SuperNode the key is bound to keeps it. (The plain run, in process:
tests/server/test_untrusted.py.)"""

import json
from pathlib import Path
from types import SimpleNamespace

from florist.apps.client import app as client_app
from florist.apps.server import run
from florist.config import RunConfig
from florist.runners.inprocess import InProcessGrid, server_identity
from florist.server.checkpoint import Checkpoint
from florist.server.exchange import Exchanger
from florist.server.loop import serve_late_joiners
from florist.server.strategy import NodeInfo

NODES = [{"partition-id": i, "num-partitions": 3} for i in range(3)]  # node ids 100, 101, 102
DISPUTE = "claimed by nodes {} and {} at once; a key bound to none of its claimers goes to none"


def _run(cfg: RunConfig, nodes: list[dict]) -> None:
    grid = InProcessGrid(client_app, nodes)
    with server_identity(grid.run_id):
        run(grid, cfg, lambda row: None, grid.run_id)


def _bound(tmp_path: Path) -> RunConfig:
    """One round of 4 nodes with bound keys."""
    values = {"model": "mlp", "num-server-rounds": 1, "min-nodes": 4, "partition": "iid", "unseen-fraction": 0.0}
    return RunConfig.from_mapping(values | {"bind-node-keys": True, "results-dir": str(tmp_path / "run")})


def test_with_bound_keys_two_first_claimers_bind_nothing_and_at_resume_the_bound_supernode_wins(tmp_path):
    cfg = _bound(tmp_path)
    _run(cfg, [*NODES, NODES[0] | {"node-key": "partition-1"}])  # node 103 squats on 101's key
    saved = Checkpoint.load(cfg.results_dir)
    assert saved.bindings == {"partition-0": 100, "partition-2": 102}  # the faster claimer bound nothing
    assert [(f["node_id"], f["reason"]) for f in saved.failures] == [
        (101, "node key 'partition-1' is " + DISPUTE.format(101, 103)),
        (103, "node key 'partition-1' is " + DISPUTE.format(101, 103)),
    ]
    _run(cfg.replace(resume_from=cfg.results_dir), [*NODES, NODES[1] | {"node-key": "partition-0"}])
    results = json.loads((Path(cfg.results_dir) / "results.json").read_text())
    assert results["complete"] and "partition-0" in [c["client"] for c in results["clients"]]
    resumed = [(f["node_id"], f["reason"]) for f in results["failures"][2:]]
    assert resumed == [(103, "node key 'partition-0' is bound to SuperNode 100")]


class JoiningGrid(InProcessGrid):
    """Nodes that connect one after the other: each call of `get_node_ids` shows one more."""

    def __init__(self, node_configs: list[dict], shown: int):
        super().__init__(client_app, node_configs)
        self.shown = shown

    def get_node_ids(self) -> list[int]:
        self.shown += 1
        return list(self.contexts)[: self.shown]


def _serve(
    bound: dict[str, int] | None, keys: list[str], count: int = 2, seconds: float = 60.0, shown=None
) -> tuple[list[str], dict, list[tuple[int, str]]]:
    """The serve phase after a run of node 100 (`partition-0`) as nodes 100, 101, ... with `keys`
    join: one more each time the server looks, or as many as `shown` says in turn."""
    grid = JoiningGrid([{"partition-id": i, "num-partitions": 8, "node-key": k} for i, k in enumerate(keys)], 1)
    if shown is not None:
        grid.get_node_ids = lambda: list(grid.contexts)[: next(shown, len(keys))]
    cfg = RunConfig.from_mapping({"serve-seconds": seconds, "serve-count": count})
    strategy = SimpleNamespace(input_shape=(1, 8, 8), serve=lambda r, nodes: {n.node_id: {"n": 1.0} for n in nodes})
    scores: dict[int, dict] = {}
    with server_identity(grid.run_id):
        exchanger = Exchanger(grid, 60.0, grid.run_id)
        run_node = NodeInfo(100, "partition-0", True, 10, 10, (1, 8, 8))
        served = serve_late_joiners(exchanger, strategy, cfg, [run_node], scores, bound)
    return [n.key for n in served], scores, [(f["node_id"], f["reason"]) for f in exchanger.failures]


# 101 names the run's key, 102 a new one, 103 the same one, then 104 and 105 keys of their own.
IN_TURN = ["partition-0", "partition-0", "partition-5", "partition-5", "partition-6", "partition-7"]


def test_in_the_serve_phase_a_key_claimed_again_goes_to_neither_unless_it_is_bound():
    served, scores, failures = _serve(None, IN_TURN)  # the first one served is struck out again
    assert served == ["partition-6", "partition-7"] and set(scores) == {104, 105}
    assert failures == [
        (101, "node key 'partition-0' is already node 100 (partition-0)'s"),
        (102, "node key 'partition-5' is " + DISPUTE.format(102, 103)),
        (103, "node key 'partition-5' is " + DISPUTE.format(102, 103)),
    ]
    bound = {"partition-0": 100}
    served, scores, failures = _serve(bound, IN_TURN)
    assert served == ["partition-5", "partition-6"] and set(scores) == {102, 104}
    assert failures == [
        (101, "node key 'partition-0' is already node 100 (partition-0)'s"),
        (103, "node key 'partition-5' is bound to SuperNode 102"),
    ]
    assert bound == {"partition-0": 100, "partition-5": 102, "partition-6": 104}


def test_a_node_left_out_for_its_input_shape_binds_no_key(tmp_path):
    """A node that claims a key alone but is left out for its input shape (28×28 among 8×8)
    must not bind it: its owner would be refused for the rest of the run and every resume."""
    cfg = _bound(tmp_path)
    _run(cfg, [*NODES, NODES[0] | {"node-key": "partition-9", "dataset": "mnist5k"}])
    saved = Checkpoint.load(cfg.results_dir)
    assert [(f["node_id"], f["reason"][:24]) for f in saved.failures] == [(103, "input shape (1, 28, 28),")]
    assert saved.bindings == {"partition-0": 100, "partition-1": 101, "partition-2": 102}


def test_a_key_two_newcomers_dispute_is_taken_from_the_late_node_served_with_it():
    """102 is served with partition-5; then 103 and 104 claim it at once: it goes to none of them."""
    keys = ["partition-0", "partition-0", "partition-5", "partition-5", "partition-5", "partition-7"]
    shown = iter([2, 3, 5])  # 101, then 102, then 103 and 104 together, then 105
    served, scores, failures = _serve(None, keys, seconds=5.0, shown=shown)
    assert served == ["partition-7"] and set(scores) == {105}
    assert failures[1:] == [
        (103, "node key 'partition-5' is " + DISPUTE.format(103, 104)),
        (104, "node key 'partition-5' is " + DISPUTE.format(103, 104)),
        (102, "node key 'partition-5' is " + DISPUTE.format(103, 104)),
    ]
