"""No malformed record crashes florist's server or a node.

Server: for `query.info` and every message type of every algorithm in the registry, hypothesis
draws replies made from a real reply of that type with one defect (a record or key missing or
extra, an array of another shape or dtype, NaN, Inf or huge values, undecodable bytes, a
broken packing layout or one whose sizes add up but whose shapes numpy cannot take (over 64
dimensions, a dimension beyond 2**63), metrics of the wrong type, a reply to another message,
an error reply whose reason is megabytes long, multi-line, escape-laden). Each goes
through the real `Exchanger.round_trip` and `ServerStrategy.ask` (or `discover`) beside another
node's good reply. Nothing may raise; a bad reply must be left out and recorded in
`exchanger.failures` with its node's name and a reason (one printable line of at most
`protocol.REASON_CHARS`, never the exchanger's catch-all), and a harmless change must change
nothing. The strategy's aggregation only ever sees what `ask` returns, so the round is then
run on the recorded replies with the accepted one in its place, or without the refused node:
the server's state stays finite. (A real round per example, every node's reply re-sent and
re-checked, would cost tens of times as much.)

Node: requests of every message type, and of unknown ones, with the same defects and bad
settings go to the ClientApp. Each is refused with an error reply (what Flower's runtimes make
of an exception) or answered, the ones that cannot be right are refused, and the node answers
the next good request with a reply the server accepts.

Secure aggregation's four stages (`query.secagg_keys` ... `query.secagg_unmask`) do not go through
`ask`: they are recorded in a FedAvg round under `secure-aggregation = "secaggplus"` (3 nodes,
threshold 2), and each example runs that round again through the real exchanges and stages
(fewer examples: `SECURE_EXAMPLES`), every node answering as recorded but the target at its
stage; once the target is left out, the others answer as the real nodes did without it (run
once from their recorded state). The replies' defects are the arrays' and the `secagg` record's;
the round must complete to a finite state with the bad reply left out as above, a harmless one
changing nothing; only shares the server cannot read may stop it, in the documented line, as
shares that do not rebuild a secret. A node meets a secure stage's request in its state as
recorded before that stage.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from florist.apps.client import app as client_app
from florist.apps.registry import STRATEGIES
from florist.apps.server import server_half
from florist.common import flower_internals, packing, protocol
from florist.common import secagg_records as secure_records
from florist.common.spec import INFO, Exchange
from florist.config import RunConfig
from florist.runners.inprocess import InProcessGrid, server_identity
from florist.server.exchange import UNDECODABLE, Exchanger
from florist.server.loop import discover
from florist.server.strategy import ServerStrategy
from florist.strategies.fedavg.spec import SECAGG

REPLIES_PER_TYPE = 1000  # malformed replies generated per message type, at least
REQUESTS_PER_TYPE = 40  # malformed requests per message type, at least (each followed by a good one: a handler run)
HARMLESS = 0.1  # room for the harmless changes drawn beside the malformed ones (about 1 in 20)
SETTINGS = {  # small and quick: 3 nodes of 12 digits partitions, an MLP, one local step where there are steps
    "model": "mlp",
    "min-nodes": 3,
    "num-server-rounds": 1,
    "partition": "iid",
    "seed": 3,
    "unseen-fraction": 0.0,
    "batch-size": 32,
    "fedattn-warmup": 0,
    "hn-hidden": 4,
    "hn-local-steps": 1,
    "hn-batch": 8,
    "ckt-steps": 1,
    "ckt-clusters": 2,
    "public-size": 20,
    "finetune-epochs": 1,
}
NODE_CONFIGS = [{"partition-id": i, "num-partitions": 12} for i in range(3)]
FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
COUNTED: collections.Counter[str] = collections.Counter()  # examples run: malformed by message type, all by kind
SECURE = "fedavg+secagg"  # FedAvg under `secure-aggregation = "secaggplus"`: 3 nodes, threshold 2
SECURE_STAGES = [e.message_type for e in SECAGG]  # in the order a secure round sends them
SECURE_EXAMPLES = 0.1  # a secure example runs a whole round again: this share of the examples of another type


# -- a federation that records, then replays--------------------------------------------------


class FuzzGrid(InProcessGrid):
    """The in-process grid, which also keeps each (phase, node, message type)'s request and reply
    as they travelled; with `answer` set, the replies come from it instead of the ClientApp."""

    def __init__(self, folder: Path):
        super().__init__(client_app, [c | {"state-dir": str(folder)} for c in NODE_CONFIGS], run_id=7)
        self.phase = ""
        self.wire: dict[tuple[str, int, str], tuple[RecordDict, RecordDict]] = {}
        self.states: dict[tuple[str, int, str], tuple[RecordDict, RecordDict]] = {}  # secure stages: node state
        self.answer: Callable[[Message], list[Message]] | None = None
        self.late: list[Message] = []  # replies beyond the first to a message
        self.first_id = ""

    def _answer(self, msg: Message) -> Message:
        self.first_id = self.first_id or msg.metadata.message_id
        if self.answer is not None:
            first, *more = self.answer(msg)
            self.late += more
            return first
        key = (self.phase, msg.metadata.dst_node_id, msg.metadata.message_type)
        state = self.contexts[key[1]].state
        before = copy.deepcopy(state) if self.phase and key[2] in SECURE_STAGES else None
        reply = super()._answer(msg)
        if self.phase:
            self.wire[key] = (msg.content, reply.content)
        if before is not None:
            self.states[key] = (before, copy.deepcopy(self.contexts[key[1]].state))
        return reply

    def live(self, msg: Message) -> Message:
        """The ClientApp's own reply, whatever `answer` says."""
        return InProcessGrid._answer(self, msg)

    def restore(self, node: int, key: tuple[str, int, str], after: bool) -> None:
        """Give `node` its run state as recorded before (or after) the message `key`."""
        self.contexts[node].state = copy.deepcopy(self.states[key][after])

    def pull_messages(self, message_ids):
        late, self.late = self.late, []
        return super().pull_messages(message_ids) + late


@dataclasses.dataclass
class Call:
    """One `ServerStrategy.ask` of a recorded phase: its arguments and what it returned."""

    exchange: Exchange
    server_round: int
    required: tuple[str, ...]
    reference: Any
    side: Any
    replies: dict


@dataclasses.dataclass(eq=False)
class Federated:
    """One algorithm's server half with three in-process nodes, and a recording of its phases
    (`info`, a training round, an evaluation): the state before each, and every ask of each."""

    cfg: RunConfig
    grid: FuzzGrid
    strategy: ServerStrategy
    nodes: list
    before: dict[str, Any] = dataclasses.field(default_factory=dict)
    done: dict[str, Any] = dataclasses.field(default_factory=dict)  # the state after each phase
    calls: dict[tuple[str, str], Call] = dataclasses.field(default_factory=dict)
    without: set = dataclasses.field(default_factory=set)  # (phase, type, node) already run without the node
    refused: dict = dataclasses.field(default_factory=dict)  # secure round's wire by (type, node) left out there

    def run(self, phase: str):
        """Run `phase` from its recorded state; return what it returned."""
        self.strategy.load_state(copy.deepcopy(self.before[phase]))
        if phase == "train":  # a secure round with every node: 3, so that one node may be left out
            return self.strategy.train_round(
                1, self.nodes if getattr(self.strategy, "secure", False) else self.nodes[:2]
            )
        return self.strategy.evaluate(1, self.nodes)

    def recipients(self, phase: str, message_type: str) -> list[int]:
        return sorted(node for p, node, t in self.grid.wire if (p, t) == (phase, message_type))

    def accepted(self, phase: str, message_type: str) -> dict[int, Any]:
        """What the server made of each node's recorded reply: its NodeInfo, or its `Reply`."""
        if phase == "info":
            return {n.node_id: n for n in self.nodes}
        return self.calls[phase, message_type].replies

    @functools.cache  # noqa: B019 (one per algorithm, kept for the session)
    def travelled(self, phase: str, node: int, message_type: str, reply: bool) -> tuple[RecordDict, RecordDict]:
        """The recorded request or reply as it travelled, and unpacked."""
        wire = self.grid.wire[phase, node, message_type][reply]
        return wire, packing.unpack(wire, "recorded")

    def aggregate(self, phase: str, message_type: str, target: int, reply) -> tuple[Any, Any]:
        """(result, state) of `phase` on the recorded replies, the target's `message_type`
        reply replaced by `reply` (None: the target failed)."""

        def ask(exchange, requests, *args):
            replies = self.calls[phase, exchange.message_type].replies
            if exchange.message_type == message_type:
                replies = {**replies, target: reply}
            return {n: r for n, r in replies.items() if n in requests and r is not None}

        self.strategy.ask = ask
        try:
            return self.run(phase), self.strategy.state()
        finally:
            del self.strategy.ask


def record(spec: str, folder: Path) -> Federated:
    """`spec`'s server half and nodes (their state in `folder`), with its phases recorded
    (`SECURE`: FedAvg's, training securely)."""
    spec, secure = spec.removesuffix("+secagg"), spec == SECURE
    extra = {"secure-aggregation": "secaggplus"} if secure else {}
    cfg = RunConfig.from_mapping(SETTINGS | extra | {"strategy": spec, "results-dir": str(folder / "results")})
    grid = FuzzGrid(folder / "nodes")
    with server_identity(grid.run_id):
        exchanger = Exchanger(grid, cfg.round_timeout, grid.run_id)
        grid.phase = "info"
        nodes = discover(exchanger, cfg, grid.get_node_ids())
        strategy = server_half(spec)(cfg, exchanger, nodes[0].input_shape, len(nodes))
        fed, real_ask = Federated(cfg, grid, strategy, nodes), strategy.ask

        def recording_ask(exchange, requests, server_round, required, reference=None, side=None):
            replies = real_ask(exchange, requests, server_round, required, reference, side)
            fed.calls[grid.phase, exchange.message_type] = Call(
                exchange, server_round, required, reference, side, replies
            )
            return replies

        strategy.ask = recording_ask
        for phase in ("train", "evaluate"):
            fed.before[phase] = copy.deepcopy(strategy.state())
            grid.phase = phase
            fed.run(phase)
            fed.done[phase] = copy.deepcopy(strategy.state())
        grid.phase = ""
        del strategy.ask
    assert not exchanger.failures, exchanger.failures
    return fed


class Federations(dict):
    """Each algorithm's recorded exchanger, made on first use."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder

    def __missing__(self, spec: str) -> Federated:
        self[spec] = record(spec, self.folder / spec)
        return self[spec]

    @functools.cache  # noqa: B019 (one instance, kept for the module)
    def phases(self, message_type: str) -> list[tuple[str, str]]:
        """(algorithm, phase) pairs whose recording sends `message_type`."""
        if message_type == INFO.message_type:
            return [(spec, "info") for spec in STRATEGIES]
        if message_type in SECURE_STAGES:  # no `ask` sends them: the secure recording only
            return [(SECURE, "train")]
        specs = [s.name for s in STRATEGIES.values() if any(e.message_type == message_type for e in s.exchanges)]
        return [
            (spec, phase)
            for spec in specs
            for phase in ("train", "evaluate")
            if (phase, message_type) in self[spec].calls
        ]

    def draw(self, data, message_type: str) -> tuple[Federated, str, int]:
        """A exchanger, phase and node that the recording sent `message_type` to."""
        spec, phase = data.draw(st.sampled_from(self.phases(message_type)))
        fed = self[spec]
        return fed, phase, data.draw(st.sampled_from(fed.recipients(phase, message_type)))

    __hash__ = object.__hash__


@pytest.fixture(scope="module")
def federations(tmp_path_factory) -> Federations:
    return Federations(tmp_path_factory.mktemp("federations"))


MESSAGE_TYPES = [INFO.message_type] + sorted({e.message_type for s in STRATEGIES.values() for e in s.exchanges})
PLACEHOLDER = protocol.content(config={})  # a request the replaying nodes answer without reading it


# -- defects --------------------------------------------------------------------------------
# Each defect names itself by a label; what a label must lead to is the side's business (below).


@dataclasses.dataclass
class Draft:
    """A content being spoiled: its records by name, and the defect's label."""

    records: dict[str, Any]
    required: tuple[str, ...]
    label: str = "unchanged"
    packed: bool = True

    def arrays(self) -> list[str]:
        return [n for n, r in self.records.items() if isinstance(r, ArrayRecord) and len(r)]

    def content(self) -> RecordDict:
        content = RecordDict(self.records)
        return packing.pack(content) if self.packed else content


FLOAT32_HUGE = (1e30, -1e30, 3e38, -3e38, 1e20, 2e9)
WRONG_DTYPES = ("float64", "float16", "int32", "int64", "uint8", "bool", "complex64", ">f4", "<U2")


def _array_defect(data, draft: Draft) -> None:
    name = data.draw(st.sampled_from(draft.arrays()))
    record = dict(draft.records[name])
    key = data.draw(st.sampled_from(sorted(record)))
    values = record[key].numpy()
    how = data.draw(
        st.sampled_from(
            [
                "missing",
                "extra",
                "shape",
                "dtype",
                *["nonfinite", "huge"] * (values.dtype.kind == "f"),  # any value is one a masked uint32 may take
                "scale",
                "corrupt",
                "drop-record",
                "retype-record",
            ]
        )
    )
    if how == "missing":
        del record[key]
    elif how == "extra":
        record[key + ".extra"] = Array(np.zeros(3, np.float32))
    elif how == "shape":
        shapes = {
            "flat+1": np.zeros(values.size + 1, values.dtype),
            "empty": np.zeros((0,), values.dtype),
            "extra-dim": values[None],
            "oversized": np.zeros(1 << 20, values.dtype),
        }
        record[key] = Array(shapes[data.draw(st.sampled_from(sorted(shapes)))])
    elif how == "dtype":
        dtype = data.draw(st.sampled_from([d for d in WRONG_DTYPES if np.dtype(d) != values.dtype]))
        record[key] = Array(values.astype(dtype))
    elif how in ("nonfinite", "huge"):
        spoiled = values.copy().reshape(-1)
        pick = [math.nan, math.inf, -math.inf] if how == "nonfinite" else FLOAT32_HUGE
        spoiled[data.draw(st.integers(0, spoiled.size - 1))] = data.draw(st.sampled_from(pick))
        record[key] = Array(spoiled.reshape(values.shape))
    elif how == "scale":
        record[key] = Array(values * np.asarray(10.0 ** data.draw(st.integers(1, 6)), values.dtype))
    elif how == "corrupt":  # travels unpacked: packing would decode it
        data_bytes = record[key].data
        blobs = {"empty": b"", "garbage": b"\x93NUMPY junk", "truncated": data_bytes[: len(data_bytes) // 2]}
        blob, stype = data.draw(st.sampled_from(sorted(blobs))), data.draw(st.sampled_from(["numpy.ndarray", "torch"]))
        record[key] = Array(dtype=str(values.dtype), shape=tuple(values.shape), stype=stype, data=blobs[blob])
        draft.packed = False
    elif how == "drop-record":
        del draft.records[name]
    else:
        draft.records[name] = ConfigRecord({"x": 1}) if data.draw(st.booleans()) else MetricRecord({key: 1.0})
    if how not in ("drop-record", "retype-record"):
        draft.records[name] = ArrayRecord(record)
    draft.label = f"array {how}"


def _metric_defect(data, draft: Draft) -> None:
    metrics = dict(draft.records[protocol.METRICS])
    counts = [k for k in protocol.COUNTS if k in metrics]
    how = data.draw(
        st.sampled_from(
            [
                "drop",
                "nonfinite",
                "list",
                "extra-bad",
                "extra-ok",
                "huge",
                "drop-record",
                "retype-record",
                *["count", "count-edge"] * bool(counts),
            ]
        )
    )
    if how == "drop":
        del metrics[data.draw(st.sampled_from(draft.required))]
    elif how in ("nonfinite", "list", "huge"):
        values = {"nonfinite": [math.nan, math.inf, -math.inf], "list": [[1.0, 2.0], [3]], "huge": [1e300, -1e300]}
        metrics[data.draw(st.sampled_from(sorted(metrics)))] = data.draw(st.sampled_from(values[how]))
    elif how == "count":
        metrics[data.draw(st.sampled_from(counts))] = data.draw(st.sampled_from([-1, 2.5, -(2**63), 2**63, 1e300]))
    elif how == "count-edge":
        metrics[data.draw(st.sampled_from(counts))] = data.draw(st.sampled_from([0, 1, 10**6]))
    elif how in ("extra-bad", "extra-ok"):
        metrics["extra"] = data.draw(st.sampled_from([math.nan, -math.inf, [1, 2]] if how == "extra-bad" else [0, 1e6]))
    elif how == "drop-record":
        del draft.records[protocol.METRICS]
    else:
        draft.records[protocol.METRICS] = ConfigRecord({k: str(v) for k, v in metrics.items()})
    if how not in ("drop-record", "retype-record"):
        draft.records[protocol.METRICS] = MetricRecord(metrics)
    draft.label = f"metric {how}"


INFO_CONFIG = {
    "node-key": [5, b"partition-0", "", ["partition-0"], True],
    "input-shape": ["1,8,8", 8, [], [0, 8, 8], [1, -8, 8], [1.5, 8.0, 8.0], ["1", "8", "8"], [True, True, True]],
}


def _info_defect(data, draft: Draft) -> None:
    config = dict(draft.records[protocol.CONFIG])
    key = data.draw(st.sampled_from(sorted(INFO_CONFIG)))
    if data.draw(st.booleans()):
        del config[key]
    else:
        config[key] = data.draw(st.sampled_from(INFO_CONFIG[key]))
    draft.records[protocol.CONFIG] = ConfigRecord(config)
    draft.label = f"info {key}"


WRONG_TYPES = {
    bool: [1, "true", [True]],
    int: ["1", b"1", True, 1.5, [1]],
    float: ["0.5", b"", True, [0.5]],
    str: [1, 1.5, True, b"x", ["x"]],
}
NODE_DECIDES = ("device",)  # settings a node takes from its own config only: whatever the server sends is ignored
ODD_VALUES = {bool: [], int: [-1], float: [math.nan, math.inf, -math.inf, -1.0, 0.0], str: ["", "?"]}


def _config_defect(data, draft: Draft) -> None:
    """A request's settings: one missing, unknown, of another type, or of an odd value."""
    config = dict(draft.records[protocol.CONFIG])
    key = data.draw(st.sampled_from(sorted(config)))
    how = data.draw(st.sampled_from(["drop", "extra", "type", *["value"] * bool(ODD_VALUES[type(config[key])])]))
    if how == "drop":
        del config[key]
        how += "-strategy" if key == "strategy" else ""
    elif how == "extra":
        config["not-a-setting"] = 1
    else:
        config[key] = data.draw(st.sampled_from((WRONG_TYPES if how == "type" else ODD_VALUES)[type(config[key])]))
        how = "node-decides" if key in NODE_DECIDES else how
    draft.records[protocol.CONFIG] = ConfigRecord(config)
    draft.label = f"config {how}"


SECAGG_ITEMS = {int: ["1", 1.5, True], bytes: ["x", 1]}  # a list's items of another kind
SECAGG_ODD = {int: [-1, 0, 2**31], float: [math.nan, math.inf, -1.0, 0.0]}


def _secagg_defect(data, draft: Draft) -> None:
    """A secure stage's `secagg` values: one missing or of another type, a list's items of another
    kind, ids and values of unequal lengths, an id repeated or foreign, a byte string spoiled (what
    the server cannot read: keys, shares encrypted for another node), an odd setting."""
    record = dict(draft.records[secure_records.SECAGG])
    key = data.draw(st.sampled_from(sorted(record)))
    value, ids = record[key], record.get("ids", [])
    items = type(value[0]) if isinstance(value, list) and value else int
    blobs = [i for i, v in enumerate(record.get("values", [])) if isinstance(v, bytes)]
    how = data.draw(
        st.sampled_from(
            [
                "drop",
                "type",
                *["items"] * isinstance(value, list),
                *["length", "id-foreign"] * bool(ids),
                *["id-duplicate"] * (len(ids) > 1),
                *["bytes"] * bool(blobs),
                *["value"] * (type(value) in SECAGG_ODD),
            ]
        )
    )
    if how == "drop":
        del record[key]
    elif how == "type":
        record[key] = data.draw(st.sampled_from(WRONG_TYPES.get(type(value), [1, "x", b"x"])))
    elif how == "items":
        record[key] = [data.draw(st.sampled_from(SECAGG_ITEMS.get(items, [b"x"])))] * max(1, len(value))
    elif how == "length":
        record["values"] = record["values"][:-1]
    elif how.startswith("id-"):
        i = data.draw(st.integers(0, len(ids) - 1))
        record["ids"] = [*ids[:i], 99 if how == "id-foreign" else ids[i - 1], *ids[i + 1 :]]
    elif how == "bytes":
        i, blob = data.draw(st.sampled_from(blobs)), data.draw(st.sampled_from(["empty", "garbage", "truncated"]))
        old = record["values"][i]
        new = {"empty": b"", "garbage": bytes(reversed(old)), "truncated": old[: len(old) // 2]}[blob]
        record["values"] = [*record["values"][:i], new, *record["values"][i + 1 :]]
    else:
        record[key] = data.draw(st.sampled_from(SECAGG_ODD[type(value)]))
    draft.records[secure_records.SECAGG] = ConfigRecord(record)
    draft.label = f"secagg {how}"


def _harmless(data, draft: Draft) -> None:
    """What a content may carry without consequence: an unknown record, a mangled timing
    record, no packing."""
    how = data.draw(st.sampled_from(["record", "timing", "unpacked"]))
    if how == "record":
        junk = {
            "config": ConfigRecord({"x": "y"}),
            "metrics": MetricRecord({"accuracy": math.nan}),
            "arrays": ArrayRecord({"a": Array(np.full(3, np.nan, np.float32)), "b": Array(np.ones(2))}),
        }
        draft.records["junk"] = junk[data.draw(st.sampled_from(sorted(junk)))]
    elif how == "timing":
        seconds = data.draw(st.sampled_from([math.nan, -1.0, "x"]))
        draft.records[protocol.TIMING] = ConfigRecord({"handler-seconds": seconds})
    else:
        draft.packed = False
    draft.label = f"harmless {how}"


def _layout_defect(data, packed: RecordDict) -> tuple[RecordDict, str]:
    """A packed record whose layout lies about its arrays, or whose arrays do not decode."""
    names = [n[: -len(packing.LAYOUT)] for n in packed.config_records if n.endswith(packing.LAYOUT)]
    name = data.draw(st.sampled_from(names))
    records = dict(packed.items())
    layout = {k: list(v) for k, v in records[name + packing.LAYOUT].items()}
    flat = dict(records[name])
    how = data.draw(
        st.sampled_from(
            [
                "short",
                "duplicate",
                "dtype",
                "shape",
                "field",
                "no-layout",
                "no-record",
                "truncated",
                "longer",
                "2d",
                "bytes",
                "deep",
                "huge-dim",
            ]
        )
    )
    i = data.draw(st.integers(0, len(layout["keys"]) - 1))
    if how == "deep":  # the values add up: only the shape is wrong
        layout["shapes"][i] = hostile_shape(data, math.prod(int(d) for d in layout["shapes"][i].split(",") if d))
    elif how == "huge-dim":  # one more array, of no values
        layout["keys"].append("extra.empty")
        layout["dtypes"].append(layout["dtypes"][i])
        layout["shapes"].append(hostile_shape(data, 0))
    elif how == "short":
        layout[data.draw(st.sampled_from(["keys", "dtypes", "shapes"]))].pop(i)
    elif how == "duplicate":
        layout["keys"][i] = layout["keys"][i - 1]
    elif how == "dtype":
        layout["dtypes"][i] = data.draw(st.sampled_from(["float64", "int8", "nonsense", ""]))
    elif how == "shape":
        layout["shapes"][i] = data.draw(
            st.sampled_from(["-1", "a", "1.5", "7,0", "99999999999,99999999999,99999999999", "4294967296,4294967296,1"])
        )
    elif how == "field":
        layout[data.draw(st.sampled_from(["keys", "dtypes", "shapes"]))] = data.draw(st.sampled_from([5, "x", [1, 2]]))
    elif how == "no-layout":
        del records[name + packing.LAYOUT]
    elif how == "no-record":
        del records[name]
    else:
        dtype = data.draw(st.sampled_from(sorted(flat)))
        values = flat[dtype].numpy()
        if how == "bytes":
            flat[dtype] = Array(dtype=dtype, shape=values.shape, stype="numpy.ndarray", data=flat[dtype].data[:-4])
        else:
            flat[dtype] = Array(
                {
                    "truncated": values[:-1],
                    "longer": np.concatenate([values, values[:1]]),
                    "2d": values[: values.size // 2 * 2].reshape(2, -1),
                }[how]
            )
        records[name] = ArrayRecord(flat)
    if how not in ("no-layout", "no-record"):
        records[name + packing.LAYOUT] = ConfigRecord(layout)
    return RecordDict(records), f"layout {how}"


def hostile_shape(data, size: int) -> str:
    """A packed shape of `size` values that no model has and numpy's reshape would refuse or
    not reach: 33 to 200 dimensions, or (no values) a zero dimension beside a huge one."""
    if size and data.draw(st.booleans()):
        dims = data.draw(st.integers(packing.MAX_DIMS + 1, 200))
        COUNTED["shape over 64 dimensions"] += dims > 64
        return ",".join(["1"] * (dims - 1) + [str(size)])
    huge = data.draw(
        st.sampled_from(["99999999999999999999", str(2**63), f"{2**62},4", "4294967296,4294967296", "1" + "0" * 5000])
    )
    return data.draw(st.sampled_from([f"0,{huge}", f"{huge},0", f"{huge},1,0"]))


def _hostile_record(data, wire: RecordDict) -> tuple[RecordDict, str]:
    """`wire` with one more packed record (as a `query.info` reply may carry): its values add
    up, its shapes numpy cannot take."""
    records, size = dict(wire.items()), data.draw(st.integers(1, 5))
    records["extra"] = ArrayRecord({"float32": Array(np.zeros(size, np.float32))})
    keys, shapes = ["a", "b"], [str(size), hostile_shape(data, 0)]
    if data.draw(st.booleans()):
        keys, shapes = ["a"], [hostile_shape(data, size)]
    layout = {"keys": keys, "dtypes": ["float32"] * len(keys), "shapes": shapes}
    records["extra" + packing.LAYOUT] = ConfigRecord(layout)
    return RecordDict(records), "layout extra record"


REASON_PARTS = [
    "INFO : round 3 done: seen accuracy 0.999",  # a forged log line, with what would start it
    "\n",
    "\r\n",
    "\x1b[2K\x1b[1G",
    "\x1b[1;32m",
    "\x1b]0;title\x07",
    "\x1b",
    "\x00\x07\x7f",
    "\u202e\u2028\u0085",
    "é ü 中",
    f"{flower_internals.HALF_UPLOADED} {flower_internals.OVERSIZED} {'9' * 5000} bytes pulled, cap 1 bytes",
]
ERROR_CODES = [*range(9), -1, 99, 2**62]  # Flower's are 0-8


def error_reply(data) -> tuple[str, Answer]:
    """An error reply the node chose: any code, a reason of escapes, line breaks and forged log
    lines, up to megabytes long."""
    code = data.draw(st.sampled_from(ERROR_CODES))
    parts = data.draw(st.lists(st.sampled_from(REASON_PARTS), max_size=8))
    padding = "x\n\x1b[31m" * data.draw(st.sampled_from([0, 10, 1000, 300_000]))
    reason = "".join(parts) + padding + "".join(parts)
    COUNTED["reason of megabytes"] += len(reason) >= 10**6
    return "error reply", sending(Error(code, reason))


def clean(reason: str) -> bool:
    """Whether a recorded reason is what logs and reports may show, and not the catch-all."""
    return reason.isprintable() and 0 < len(reason) <= protocol.REASON_CHARS and UNDECODABLE not in reason


def spoiled(
    data, wire: RecordDict, content: RecordDict, required: tuple[str, ...], defects: list[Callable]
) -> tuple[str, RecordDict]:
    """(label, content) for a real content, as it travelled (`wire`) and unpacked, with one of
    `defects` that applies, a broken packing, no records at all, or (1 in 20) a harmless
    change; packed or not, as florist's replies and requests may be."""
    draft = Draft(dict(content.items()), required, packed=data.draw(st.booleans()))
    applicable = [
        d
        for d in defects
        if {
            _array_defect: draft.arrays(),
            _metric_defect: protocol.METRICS in draft.records,
            _secagg_defect: isinstance(draft.records.get(secure_records.SECAGG), ConfigRecord),
        }.get(d, True)
    ]
    choice = data.draw(st.integers(0, 19))
    if choice == 0:
        return "empty", RecordDict()
    if choice <= 3 and packing.is_packed(wire):
        return _layout_defect(data, wire)[::-1]
    if choice == 5:
        return _hostile_record(data, wire)[::-1]
    defect = _harmless if choice == 4 else data.draw(st.sampled_from(applicable))
    defect(data, draft)
    return draft.label, draft.content()


def kind_of(label: str, kinds: dict[str, str], default: str) -> str:
    return next((kind for start, kind in kinds.items() if label.startswith(start)), default)


# -- checks -----------------------------------------------------------------------------------


def leaves(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, value) of everything a state, reply or NodeInfo holds, in a fixed order."""
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from leaves(value[key], (*path, key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from leaves(item, (*path, i))
    elif dataclasses.is_dataclass(value):
        yield from leaves(dataclasses.asdict(value), path)
    else:
        yield path, value


def same(a: Any, b: Any) -> bool:
    left, right = list(leaves(a)), list(leaves(b))
    return [p for p, _ in left] == [p for p, _ in right] and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for (_, x), (_, y) in zip(left, right)
    )


def all_finite(value: Any) -> bool:
    return all(
        bool(torch.isfinite(leaf).all())
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
        else not isinstance(leaf, float) or math.isfinite(leaf)
        for _, leaf in leaves(value)
    )


@pytest.fixture(autouse=True)
def quiet_failures():
    """Thousands of refused replies would each log a warning."""
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    print("\nfuzzed examples:", dict(sorted(COUNTED.items())))


Answer = Callable[[Message, dict[int, str]], list[Message]]  # the target's replies to a message, given the ids sent


def sending(content: RecordDict | Error) -> Answer:
    return lambda msg, sent: [Message(content, reply_to=msg)]


def check_reply(fed: Federated, phase: str, message_type: str, target: int, answer: Answer, others: list[int]):
    """Send `message_type` to `others` and `target` through the real exchange and checks, the
    target answering with `answer`, the others as recorded; return what the checks let
    through (by node) and the failures recorded."""
    exchanger, sent = fed.strategy.exchanger, {}
    exchanger.failures.clear()
    exchanger.take_exchanges()

    def answered(msg: Message) -> list[Message]:
        node = msg.metadata.dst_node_id
        sent[node] = msg.metadata.message_id
        if node == target:
            return answer(msg, sent)
        return [Message(fed.grid.wire[phase, node, message_type][1], reply_to=msg)]

    fed.grid.answer = answered
    try:
        if phase == "info":
            got = {n.node_id: n for n in discover(exchanger, fed.cfg, [*others, target])}
        else:
            call = fed.calls[phase, message_type]
            got = type(fed.strategy).ask(
                fed.strategy,
                call.exchange,
                dict.fromkeys([*others, target], PLACEHOLDER),
                call.server_round,
                call.required,
                call.reference,
                call.side,
            )
    finally:
        fed.grid.answer = None
    return got, list(exchanger.failures)


# -- the secure stages: the recorded round again --------------------------------------------


def run_secure(fed: Federated, answered: Callable[[Message], list[Message]]) -> tuple[Any, str]:
    """(state, stop) of the recorded secure round run again, the nodes answering `answered`;
    stop: the one line a round that stops says ("" when it completed)."""
    fed.grid.answer = answered
    try:
        fed.run("train")
        stop = ""
    except RuntimeError as err:  # secure_round's stop: below the threshold, shares that do not rebuild
        stop = str(err)
    finally:
        fed.grid.answer = None
    return fed.strategy.state(), stop


def recorded(wire: dict, msg: Message) -> list[Message]:
    return [Message(wire["train", msg.metadata.dst_node_id, msg.metadata.message_type][1], reply_to=msg)]


def without(fed: Federated, message_type: str, target: int) -> dict:
    """The secure round's wire with `target` left out at `message_type`: the stages before it,
    and the others' replies at it, as recorded; the later ones as the real nodes answer them, each
    from its state as recorded after `message_type` (made once, then kept)."""
    if (message_type, target) not in fed.refused:
        stage, wire = SECURE_STAGES.index(message_type), {}
        fed.strategy.exchanger.failures.clear()

        def answered(msg: Message) -> list[Message]:
            node, now = msg.metadata.dst_node_id, msg.metadata.message_type
            later = SECURE_STAGES.index(now) - stage
            if later < 0 or (later == 0 and node != target):
                return recorded(fed.grid.wire, msg)
            if later == 0:
                return [Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "left out"), reply_to=msg)]
            if not any(n == node for _, n, _ in wire):
                fed.grid.restore(node, ("train", node, message_type), after=True)
            reply = fed.grid.live(msg)
            wire["train", node, now] = (msg.content, reply.content)
            return [reply]

        state, stop = run_secure(fed, answered)
        failures = fed.strategy.exchanger.failures
        assert not stop and all_finite(state) and [f["node_id"] for f in failures] == [target], (stop, failures)
        fed.refused[message_type, target] = wire
    return fed.refused[message_type, target]


def replay_secure(fed: Federated, message_type: str, target: int, answer: Answer) -> tuple[Any, list[dict], str]:
    """The recorded secure round through the real exchanges and stages, every node answering as
    recorded but `target`, which answers `message_type` with `answer`; once it is left out, the
    others answer as they did without it (`without`). Return the state after, the failures
    recorded and the round's stop ("" when it completed)."""
    exchanger, sent, stage = fed.strategy.exchanger, {}, SECURE_STAGES.index(message_type)
    left_out = without(fed, message_type, target) if stage < len(SECURE_STAGES) - 1 else fed.grid.wire
    exchanger.failures.clear()
    exchanger.take_exchanges()

    def answered(msg: Message) -> list[Message]:
        node, now = msg.metadata.dst_node_id, msg.metadata.message_type
        if now == message_type:
            sent[node] = msg.metadata.message_id
            if node == target:
                return answer(msg, sent)
        gone = SECURE_STAGES.index(now) > stage and any(f["node_id"] == target for f in exchanger.failures)
        return recorded(left_out if gone else fed.grid.wire, msg)

    state, stop = run_secure(fed, answered)
    return state, list(exchanger.failures), stop


def accepted_securely(fed: Federated, message_type: str, node: int, reply: Message) -> bool:
    """Whether the server takes `reply` at its secure stage, and the round completes. A share-keys
    reply answered afresh commits to fresh shares, while the others' recorded unmask replies reveal
    the recorded ones: it goes with the recorded commitments, which the server checks those against."""
    content = reply.content if not reply.has_error() else None
    if content is not None and message_type == SECURE_STAGES[1] and secure_records.SECAGG in content.config_records:
        content = copy.deepcopy(content)
        kept = fed.grid.wire["train", node, message_type][1].config_records[secure_records.SECAGG]
        for key in ("commit-ids", "commits"):
            content.config_records[secure_records.SECAGG][key] = kept[key]
    _, failures, stop = replay_secure(fed, message_type, node, sending(reply.error if content is None else content))
    return not failures and not stop


# -- the server -------------------------------------------------------------------------------

BAD, BENIGN, EXTREME = "bad", "benign", "extreme"  # must be refused / must change nothing / may pass
REPLY_KINDS = {
    "harmless": BENIGN,
    "array scale": EXTREME,
    "metric extra-ok": EXTREME,
    "metric count-edge": EXTREME,
    "metric huge": EXTREME,
    "secagg bytes": EXTREME,  # keys and shares the server cannot read: what a node makes of them is its own
    "secagg id-foreign": EXTREME,  # an unmask reply's shares of a node not in the round: left unused
}


def misdirected(data, grid: FuzzGrid, content: RecordDict, to_other: bool) -> tuple[str, Answer]:
    """The target's own, valid reply as a reply to another message: another node's, an earlier
    one, none. Its own message then expires, and the SuperLink answers it with an error."""
    which = data.draw(st.sampled_from(["earlier", "no", *["another node's"] * to_other]))

    def answer(msg: Message, sent: dict[int, str]) -> list[Message]:
        reply = Message(content, reply_to=msg)
        other = next((i for n, i in sent.items() if n != msg.metadata.dst_node_id), "")
        reply.metadata.__dict__["_reply_to_message_id"] = {"earlier": grid.first_id, "no": "", "another node's": other}[
            which
        ]
        return [Message(Error(ErrorCode.MESSAGE_UNAVAILABLE, "expired"), reply_to=msg), reply]

    return f"reply to {which} message", answer


def malformed_reply(
    data, fed: Federated, key: tuple[str, int, str], to_other: bool, required: tuple[str, ...], defects: list
) -> tuple[str, Answer, str]:
    """(label, answer, kind) of a malformed reply to the recorded message `key`: misdirected, an
    error, or the recorded reply spoiled by one of `defects`; counted."""
    if (pick := data.draw(st.integers(0, 19))) <= 1:
        label, answer = misdirected(data, fed.grid, fed.grid.wire[key][1], to_other)
    elif pick == 2:
        label, answer = error_reply(data)
    else:
        label, content = spoiled(data, *fed.travelled(*key, reply=True), required, defects)
        answer = sending(content)
    kind = kind_of(label, REPLY_KINDS, BAD)
    COUNTED.update([f"reply {kind}", *[f"malformed reply {key[2]}"] * (kind != BENIGN)])
    return label, answer, kind


def check_secure_replies(fed: Federated, message_type: str) -> None:
    """A secure stage's malformed replies, each in the recorded secure round run again: the round
    completes (3 nodes, threshold 2: one left out leaves enough) to a finite state, the bad reply
    left out as its node's failure, a harmless one changing nothing. Only shares the server cannot
    read, that then do not rebuild a secret, or a masked vector that moves the sums out of honest
    nodes' range, may stop the round, in the documented line."""

    @settings(FUZZ, max_examples=int(REPLIES_PER_TYPE * SECURE_EXAMPLES * (1 + HARMLESS)))
    @given(st.data())
    def check(data):
        target = data.draw(st.sampled_from(fed.recipients("train", message_type)))
        key = ("train", target, message_type)
        label, answer, kind = malformed_reply(data, fed, key, True, (), [_array_defect, _secagg_defect])
        with server_identity(fed.grid.run_id):
            state, failures, stop = replay_secure(fed, message_type, target, answer)
        assert all(f["node_id"] == target for f in failures), (label, failures)
        assert all_finite(state), label
        if stop:  # documented in florist/server/secure.py; a share the server cannot read, or a masked sum no
            # honest nodes make (florist/common/secagg_checks.py)
            documented = "do not rebuild" in stop or "a node altered its masked vector" in stop
            assert kind == EXTREME and documented and stop.isprintable(), (label, stop)
            COUNTED[f"stopped {message_type}"] += 1
        elif not failures:
            assert kind != BAD, f"{label}: accepted"
            assert kind != BENIGN or same(state, fed.done["train"]), f"{label}: not harmless"
        else:
            assert len(failures) == 1 and clean(failures[0]["reason"]), (label, failures[0]["reason"][:400])
            assert failures[0]["node"] == fed.strategy.exchanger.name(target)
            assert failures[0]["message_type"] == message_type

    check()
    assert COUNTED[f"malformed reply {message_type}"] >= REPLIES_PER_TYPE * SECURE_EXAMPLES


@pytest.mark.parametrize("message_type", MESSAGE_TYPES)
def test_a_malformed_reply_is_refused_and_what_passes_the_checks_keeps_the_state_finite(federations, message_type):
    """Every malformed reply of `message_type` is refused and recorded as its node's failure,
    naming the node and why; a harmless change is accepted as if it were not there; and the
    round runs on whatever the checks let through, or without the refused node, to a finite
    state."""
    info = message_type == INFO.message_type
    if message_type in SECURE_STAGES:
        check_secure_replies(federations[SECURE], message_type)
        return
    defects = [_info_defect, _metric_defect] if info else [_array_defect, _metric_defect]

    @settings(FUZZ, max_examples=int(REPLIES_PER_TYPE * (1 + HARMLESS)))
    @given(st.data())
    def check(data):
        fed, phase, target = federations.draw(data, message_type)
        accepted = fed.accepted(phase, message_type)
        others = [n for n in fed.recipients(phase, message_type) if n != target][: data.draw(st.integers(0, 1))]
        required = protocol.INFO_METRICS if info else fed.calls[phase, message_type].required
        label, answer, kind = malformed_reply(data, fed, (phase, target, message_type), bool(others), required, defects)
        with server_identity(fed.grid.run_id):
            got, failures = check_reply(fed, phase, message_type, target, answer, others)
            assert all(f["node_id"] == target for f in failures) and all(same(got[n], accepted[n]) for n in others)
            if target in got:
                assert not failures and kind != BAD, f"{label}: accepted"
                changed = not same(got[target], accepted[target])
                assert not (changed and kind == BENIGN), f"{label}: not harmless"
                if changed and not info:
                    COUNTED[f"aggregated {message_type}"] += 1
                    assert all_finite(fed.aggregate(phase, message_type, target, got[target])), label
            else:
                assert len(failures) == 1 and clean(failures[0]["reason"]), (label, failures[0]["reason"][:400])
                assert failures[0]["node"] == fed.strategy.exchanger.name(target)
                assert failures[0]["message_type"] == message_type
                if not info and (phase, message_type, target) not in fed.without:
                    fed.without.add((phase, message_type, target))
                    assert all_finite(fed.aggregate(phase, message_type, target, None))

    check()
    assert COUNTED[f"malformed reply {message_type}"] >= REPLIES_PER_TYPE


@pytest.mark.parametrize("message_type", [INFO.message_type, "train"])
def test_the_fuzzer_reaches_numpys_reshape_and_the_error_path_and_each_only_leaves_its_node_out(
    federations, message_type
):
    """Packed replies whose sizes add up but whose shapes numpy cannot take (over 64 dimensions
    among them) and error replies of megabytes (escapes, line breaks, forged log lines) are
    drawn, reach the restore and the error path, and each leaves only its node out with a
    clean one-line reason: no exception escapes (FedAvg's discovery and training replies)."""
    fed, phase = federations["fedavg"], "info" if message_type == INFO.message_type else "train"
    before = COUNTED.copy()

    @settings(FUZZ, max_examples=80)
    @given(st.data())
    def check(data):
        target = data.draw(st.sampled_from(fed.recipients(phase, message_type)))
        others = [n for n in fed.recipients(phase, message_type) if n != target]
        wire = fed.grid.wire[phase, target, message_type][1]
        if data.draw(st.booleans()):
            label, answer = error_reply(data)
        elif packing.is_packed(wire) and data.draw(st.booleans()):
            content, label = _layout_defect(data, wire)  # any layout defect, the hostile shapes among them
            answer = sending(content)
        else:
            content, label = _hostile_record(data, wire)
            answer = sending(content)
        with server_identity(fed.grid.run_id):
            got, failures = check_reply(fed, phase, message_type, target, answer, others)
        assert target not in got and set(got) == set(others), label
        assert len(failures) == 1 and clean(failures[0]["reason"]), (label, failures[0]["reason"][:400])

    check()
    drawn = COUNTED - before
    assert drawn["shape over 64 dimensions"] > 0 and drawn["reason of megabytes"] > 0, drawn


# -- the node ---------------------------------------------------------------------------------

REFUSED, GOOD, ANY = "refused", "good", "any"  # an error reply / a reply the server accepts / either, or garbage
REQUEST_KINDS = {
    "harmless": GOOD,
    "array scale": ANY,
    "config value": ANY,
    "config node-decides": ANY,
    "config drop-strategy": ANY,
    "empty": ANY,
    "other type": ANY,
    "secagg value": ANY,  # an odd setup value: the node cannot tell it from the server's choice
    "secagg bytes": ANY,  # keys and shares the node may only find wrong when it uses them
    "secagg id-foreign": ANY,
}
UNKNOWN_TYPES = ("train.nope", "evaluate.nope", "query.nope")


def answer_of(fed: Federated, node: int, message_type: str, content: RecordDict) -> Message:
    """The node's reply to a message of `message_type` with `content`, as a runtime gives it."""
    msg = Message(content, dst_node_id=node, message_type=message_type, group_id="1", ttl=fed.cfg.round_timeout)
    return fed.grid.send_and_receive([msg])[0]


def accepted_by_server(fed: Federated, phase: str, message_type: str, node: int, reply: Message) -> bool:
    if message_type in SECURE_STAGES:
        return accepted_securely(fed, message_type, node, reply)
    answer = sending(reply.error if reply.has_error() else reply.content)
    got, _ = check_reply(fed, phase, message_type, node, answer, [])
    return node in got


@pytest.mark.parametrize("message_type", MESSAGE_TYPES)
def test_a_node_refuses_a_malformed_request_and_answers_the_next_good_one(federations, message_type):
    """Every malformed request of `message_type` (or sent as another type, or an unknown one)
    is refused with an error reply, or answered; one that cannot be right is refused; and the
    node's next good request gets a reply the server accepts. A secure stage's request meets the
    node in its state as recorded before that stage; a refused one must leave that state as it
    was, and after one answered the node is put back (a stage answered twice is refused)."""
    secure = message_type in SECURE_STAGES
    defects = [_array_defect, _config_defect, *[_secagg_defect] * secure]

    @settings(FUZZ, max_examples=int(REQUESTS_PER_TYPE * (1 + HARMLESS)) + 10)
    @given(st.data())
    def check(data):
        fed, phase, node = federations.draw(data, message_type)
        if secure:
            fed.grid.restore(node, (phase, node, message_type), after=False)
        label, content = spoiled(data, *fed.travelled(phase, node, message_type, reply=False), (), defects)
        sent_as = message_type
        if data.draw(st.integers(0, 7)) == 0:
            sent_as = data.draw(st.sampled_from([*UNKNOWN_TYPES, *(t for t in MESSAGE_TYPES if t != message_type)]))
            label = "unknown type" if sent_as in UNKNOWN_TYPES else "other type"
        kind = kind_of(label, REQUEST_KINDS, REFUSED)
        COUNTED.update([f"request {kind}", *[f"malformed request {message_type}"] * (kind != GOOD)])
        with server_identity(fed.grid.run_id):
            reply = answer_of(fed, node, sent_as, content)
            if kind != ANY:
                good = not reply.has_error() and accepted_by_server(fed, phase, message_type, node, reply)
                assert good == (kind == GOOD), f"{label}: {reply.error if reply.has_error() else 'answered'}"
            if secure and not reply.has_error():
                fed.grid.restore(node, (phase, node, message_type), after=False)
            again = answer_of(fed, node, message_type, fed.grid.wire[phase, node, message_type][0])
            assert accepted_by_server(fed, phase, message_type, node, again), f"after {label}: {again.error}"

    check()
    assert COUNTED[f"malformed request {message_type}"] >= REQUESTS_PER_TYPE
