"""Size caps on replies (`max-reply-mb`, `Exchanger.reply_cap`): a reply over its cap is refused,
named, before any copy of it is made; the others count. In-process federations (the reply is
held whole there, as off the deployment fast path), and the fast path's pull cap against a
Grid that pulls a reply's objects as Flower's deployment Grid does."""

import math
import re
import time

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.supercore.inflatable import inflatable_utils
from flwr.superlink.grid import http_grid

from florist.apps.client import app as client_app
from florist.apps.client import build_client_app
from florist.apps.server import run
from florist.common import flower_internals, packing, protocol
from florist.config import RunConfig
from florist.runners.inprocess import InProcessGrid, server_identity
from florist.server.exchange import REPLY_SLACK, Exchanger

BULKY = 101  # partition 1's node id in the in-process grid
HUGE = 50_000_000  # float32 values: 200 MB
RUN = {
    "model": "mlp",
    "min-nodes": 3,
    "num-server-rounds": 1,
    "partition": "iid",
    "unseen-fraction": 0.0,
    "eval-every": 0,
    "local-epochs": 1,
}


def bulky(where: str):
    """A client mod: partition 1's `train` reply carries 200 MB more: a record of its own
    (`extra`, which today's checks never look at) or in place of its packed model (`packed`)."""

    def mod(msg: Message, context: Context, call_next) -> Message:
        reply = call_next(msg, context)
        if context.node_config["partition-id"] != 1 or msg.metadata.message_type != "train":
            return reply
        values = np.full(HUGE, 0.5, dtype=np.float32)
        if where == "extra":
            reply.content["junk"] = ArrayRecord({"x": Array(values)})
        else:  # packed as florist's ClientApp packs it after its mods, the layout left as it was
            reply.content = packing.pack(reply.content)
            assert list(reply.content[protocol.ARRAYS]) == ["float32"]
            reply.content[protocol.ARRAYS] = ArrayRecord({"float32": Array(values)})
        return reply

    return mod


def _hwm_mb() -> float:
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read())[1]) / 1024


def _rss_mb() -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read())[1]) / 1024


class MeasuredGrid(InProcessGrid):
    """The in-process Grid, measuring this process's peak RSS from each pull (the replies
    already held whole, as a Grid holds them) to the next call: what the server does with them."""

    windows: list[float]
    base: float | None = None

    def _close(self) -> None:
        if self.base is not None:
            self.windows.append(_hwm_mb() - self.base)
            self.base = None

    def push_messages(self, messages):
        self._close()
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        self._close()
        replies = super().pull_messages(message_ids)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the peak RSS starts again from here
        self.base = _rss_mb()
        return replies


@pytest.mark.parametrize("where", ["extra", "packed"])
def test_a_200_mb_reply_is_refused_named_and_never_copied_while_the_others_count(tmp_path, where):
    cfg = RunConfig.from_mapping(RUN | {"results-dir": str(tmp_path)})
    grid = MeasuredGrid(build_client_app([bulky(where)]), [{"partition-id": i, "num-partitions": 3} for i in range(3)])
    grid.windows = []
    with server_identity(grid.run_id):
        results = run(grid, cfg, run_id=grid.run_id)
    grid._close()
    [failure] = results.failures
    assert failure["node_id"] == BULKY and failure["node"] == "node 101 (partition-1)"
    assert failure["message_type"] == "train" and failure["round"] == 1
    cap = REPLY_SLACK / protocol.MB  # plus twice the MLP (a few hundred kB)
    assert re.fullmatch(
        rf"its reply of 200\.\d MB is over its cap of {cap:.0f}\.\d MB \(max-reply-mb\)", failure["reason"]
    )
    assert results.rounds[0]["train_loss"] is not None and math.isfinite(results.rounds[0]["train_loss"])
    assert results.rounds[0]["bytes_up"] > 200 * protocol.MB  # counted as it came, unread
    # What the server did with the replies it held took < 50 MB: never a copy of the 200 MB.
    assert max(grid.windows) < 50, grid.windows


def _exchanger(max_reply_mb: float = 0.0) -> tuple[Exchanger, InProcessGrid]:
    grid = InProcessGrid(client_app, [{"partition-id": 0, "num-partitions": 1}], run_id=5)
    return Exchanger(grid, 10.0, grid.run_id, max_reply_mb), grid


def test_the_cap_is_max_reply_mb_or_twice_what_the_exchange_expects_plus_the_slack():
    request = protocol.content(ArrayRecord({"w": Array(np.zeros(1000, np.float32))}))
    assert _exchanger(2.5)[0].reply_cap(request) == 2_500_000
    assert _exchanger()[0].reply_cap(request) == 2 * len(request["arrays"]["w"].data) + REPLY_SLACK
    expect = {protocol.ARRAYS: {"w": torch.zeros(10, 10)}, protocol.SIDE: {"z": torch.zeros(5, dtype=torch.float64)}}
    assert _exchanger()[0].reply_cap(request, expect) == 2 * (400 + 40) + REPLY_SLACK


def test_max_reply_mb_refuses_a_reply_the_automatic_cap_would_take(tmp_path):
    exchanger, _ = _exchanger(max_reply_mb=0.00001)  # 10 bytes: below any info reply
    with server_identity(5):
        request = protocol.content(config={"run-id": 5})
        assert exchanger.round_trip({100: request}, "query.info", 0) == {}
    [failure] = exchanger.failures
    assert re.fullmatch(r"its reply of \d+\.\d MB is over its cap of 0\.0 MB \(max-reply-mb\)", failure["reason"])
    exchanger, _ = _exchanger()
    with server_identity(5):
        assert list(exchanger.round_trip({100: protocol.content(config={"run-id": 5})}, "query.info", 0)) == [100]


def test_run_config_refuses_a_negative_cap():
    with pytest.raises(ValueError, match="max-reply-mb must be a finite number >= 0"):
        RunConfig.from_mapping({"max-reply-mb": -1.0})


def test_a_declared_shape_or_dtype_is_refused_before_its_bytes_are_decoded():
    reference = {"w": torch.zeros(4, 4)}

    def lying(**fields) -> ArrayRecord:
        honest = Array(np.zeros((4, 4), np.float32))
        values = {"dtype": honest.dtype, "shape": honest.shape, "stype": honest.stype, "data": honest.data} | fields
        return ArrayRecord({"w": Array(**values)})

    for fields, said in [
        ({"shape": (4, 5)}, r"has shape \(4, 5\), expected \(4, 4\)"),
        ({"dtype": "float64"}, "has dtype torch.float64, expected torch.float32"),
        ({"data": b"\0" * (2**17)}, "holds 131072 bytes, more than its shape"),
    ]:
        with pytest.raises(protocol.ProtocolError, match=said):
            protocol.check_declared(lying(**fields), reference, "node 7")
    layout = ConfigRecord({"keys": ["w"], "dtypes": ["float32"], "shapes": ["4,4"]})
    big = RecordDict({"arrays": ArrayRecord({"float32": Array(np.zeros(17, np.float32))}), "arrays.layout": layout})
    with pytest.raises(packing.PackingError, match="17 values for a layout of 16"):
        packing.unpack(big, "node 7")


# -- the fast path: the ServerApp stops pulling a reply once it passes its cap -------------------

CHUNK = 5 * 2**20  # Flower's largest ArrayChunk


class SuperLinkWithABulkyReply(InProcessGrid):
    """Flower's deployment Grid, as far as the exchange can tell: node 101's reply is 400 chunks
    of 5 MB (2 GB) on the SuperLink, and a poll pulls them through `http_grid.pull_objects`, as
    `HttpGrid.pull_messages` does, making the same error reply when the pull fails."""

    pulled = 0

    def _answer(self, msg: Message) -> Message:
        return Message(RecordDict(), reply_to=msg)

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        self.sent = {m.metadata.message_id: m for m in messages}
        return ids

    def pull_messages(self, message_ids):
        replies = []
        for reply in super().pull_messages(message_ids):
            if reply.metadata.src_node_id != BULKY:
                replies.append(reply)
                continue
            chunk = bytes(CHUNK)  # one buffer, handed out again and again

            def pull_object(object_id: str) -> bytes:
                self.pulled += 1
                time.sleep(0.001)
                return chunk

            try:
                http_grid.pull_objects(object_ids=[f"{i:064x}" for i in range(400)], pull_object_fn=pull_object)
            except inflatable_utils.ObjectPullError as e:
                reason = f"{flower_internals.HALF_UPLOADED}. The sender may not have ... {e}"
                sent = self.sent[reply.metadata.reply_to_message_id]
                replies.append(Message(Error(ErrorCode.MESSAGE_UNAVAILABLE, reason), reply_to=sent))
            else:
                replies.append(reply)
        return replies


class FastPathGrid(SuperLinkWithABulkyReply, http_grid.HttpGrid):
    """The same, seen as Flower's deployment Grid (`flower_internals.pull_replies` caps its pulls)."""


def test_on_the_fast_path_a_2_gb_reply_is_pulled_no_further_than_its_cap():
    grid = FastPathGrid(client_app, [{"partition-id": i, "num-partitions": 2} for i in range(2)], run_id=5)
    exchanger = Exchanger(grid, 30.0, grid.run_id, max_reply_mb=50.0)
    with server_identity(grid.run_id):
        good = exchanger.round_trip({100: RecordDict(), BULKY: RecordDict()}, "query.info", 1)
    assert list(good) == [100]
    [failure] = exchanger.failures
    assert failure["node_id"] == BULKY
    assert re.fullmatch(
        r"its reply is over its cap of 50\.0 MB \(max-reply-mb\): 5\d\.\d MB or more, no more pulled", failure["reason"]
    ), failure["reason"]
    assert grid.pulled <= 50 * protocol.MB // CHUNK + 3  # the cap's worth, and what the pull threads had begun


def test_the_grids_error_for_an_oversized_reply_is_told_from_a_half_upload():
    said = f"{flower_internals.HALF_UPLOADED}. ... {flower_internals.OVERSIZED} 123 bytes pulled, cap 100 bytes"
    assert flower_internals.oversized(Error(ErrorCode.MESSAGE_UNAVAILABLE, said)) == (123, 100)
    assert (
        flower_internals.oversized(Error(ErrorCode.MESSAGE_UNAVAILABLE, f"{flower_internals.HALF_UPLOADED}.")) is None
    )
    assert flower_internals.oversized(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, said)) is None
