"""Whatever nodes say about themselves at discovery (keys of any length and characters, the
same key twice, a key bound to another SuperNode, counts and input shapes of any size), the
ServerApp never crashes: `start_nodes` returns the nodes it can use or stops with its one-line
RuntimeError, every node it leaves out is named in the failures with a reason, and a key two
nodes claim is held by neither unless it was bound to one before.

The nodes' `query.info` replies are drawn by hypothesis and answered through the in-process
grid, so the real `Exchanger` and `discover` read them, as they read a SuperNode's."""

from __future__ import annotations

import math

from flwr.app import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from florist.common import protocol
from florist.common.protocol import NODE_KEY
from florist.config import RunConfig
from florist.runners.inprocess import InProcessGrid, _copy, server_identity
from florist.server.exchange import Exchanger
from florist.server.loop import discover, start_nodes

FUZZ = settings(
    max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
CFG = RunConfig.from_mapping({"min-nodes": 1, "node-wait-timeout": 5.0})

keys = st.one_of(
    st.sampled_from(["a", "b", "node-1", "partition-0"]),  # the same key again and again
    st.from_regex(NODE_KEY, fullmatch=True),
    st.text(max_size=300),  # any character: newlines, ANSI escapes, NUL, surrogates aside
    st.text(alphabet="0123456789", min_size=4000, max_size=6000),  # int() of it raised once
    st.integers(),
    st.none(),
)
counts = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True), st.booleans())
shapes = st.one_of(
    st.lists(st.integers(-3, 2**40), max_size=6),
    st.sampled_from([[1, 8, 8], [64], [3, 32, 32]]),  # honest ones, so that some runs have nodes
    st.text(max_size=5),
)
replies = st.fixed_dictionaries(
    {"node-key": keys, "input-shape": shapes, "num-train": counts, "num-test": counts, "seen": counts}
)
honest = st.fixed_dictionaries(  # well-formed, so that two of them often claim one key
    {
        "node-key": st.sampled_from(["a", "b", "partition-0"]),
        "input-shape": st.just([1, 8, 8]),
        "num-train": st.integers(1, 100),
        "num-test": st.integers(1, 100),
        "seen": st.just(1),
    }
)


class ScriptedGrid(InProcessGrid):
    """Nodes whose info replies are the drawn ones."""

    def __init__(self, infos: list[dict]):
        super().__init__(None, [{}] * len(infos))
        self.infos = dict(zip(self.contexts, infos))

    def _answer(self, msg: Message) -> Message:
        info = self.infos[msg.metadata.dst_node_id]
        config = {k: info[k] for k in ("node-key", "input-shape") if info[k] is not None}
        metrics = {k: info[k] for k in ("num-train", "num-test", "seen") if not isinstance(info[k], bool)}
        try:  # as it would arrive: serialized by the node, deserialized here
            content = _copy(protocol.content(config=config, metrics=metrics))
        except (TypeError, ValueError):  # a value Flower's records cannot hold never leaves a node
            content = protocol.content(config={}, metrics={})
        return Message(content, reply_to=msg)


@FUZZ
@given(
    infos=st.lists(st.one_of(replies, honest), min_size=1, max_size=6),
    bound=st.dictionaries(st.sampled_from("ab"), st.integers(100, 106)),
)
def test_no_info_reply_crashes_discovery_and_every_node_left_out_is_named(infos, bound):
    grid, before = ScriptedGrid(infos), dict(bound)
    with server_identity(grid.run_id):
        exchanger = Exchanger(grid, 60.0, grid.run_id)
        try:
            nodes = start_nodes(exchanger, CFG, bound)
        except RuntimeError as err:  # no usable node: its one line
            assert str(err).startswith(("no node answered", "only ", "no seen node")) and "\n" not in str(err)
            nodes = None
        late = discover(exchanger, CFG, grid.get_node_ids(), {n.key: f"already {n}'s" for n in nodes or []}, bound)
    assert all(f["reason"] and "\n" not in f["reason"] and len(f["node"]) < 200 for f in exchanger.failures)
    if nodes is None:  # the run stopped in its one line: no node list to check
        return
    keys = [n.key for n in nodes]
    assert len(set(keys)) == len(keys) and all(NODE_KEY.fullmatch(k) for k in keys)
    assert all(bound[n.key] == n.node_id for n in nodes)
    ill_formed = {f["node_id"] for f in exchanger.failures if f["reason"].startswith("ill-formed info reply")}
    for node in nodes:  # a key another node also claimed is held only by the SuperNode it was bound to before
        rivals = [i for i, info in zip(grid.contexts, infos) if info["node-key"] == node.key and i not in ill_formed]
        assert rivals == [node.node_id] or before.get(node.key) == node.node_id
    assert not {n.key for n in late} & set(keys)  # a node that joins later never takes a key in use
    left_out = set(grid.contexts) - {n.node_id for n in nodes}
    assert left_out <= {f["node_id"] for f in exchanger.failures}
    assert all(math.prod(n.input_shape) <= protocol.MAX_INPUT_VALUES for n in nodes)
