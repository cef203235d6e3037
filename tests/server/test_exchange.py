"""The server's exchange with the nodes: a node that never replies is left out once the round's
timeout has passed, however long the polls themselves take, and a node cut off while it uploads
its reply costs the others nothing."""

import math
import time

import flwr
from flwr.app import Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.supercore.inflatable import inflatable_utils
from flwr.superlink.grid import http_grid

from florist.apps.client import app as client_app
from florist.common import flower_internals
from florist.runners.inprocess import InProcessGrid, server_identity
from florist.server.exchange import Exchanger

SILENT, POLL = 101, 0.3


class EmptyReplies(InProcessGrid):
    """Every node replies at once with an empty content (no handler runs)."""

    def _answer(self, msg: Message) -> Message:
        return Message(RecordDict(), reply_to=msg)


class SlowGridWithASilentNode(EmptyReplies):
    """Every node but `SILENT` replies; every poll takes `POLL` seconds, as pulls from a busy
    SuperLink over TLS can."""

    def pull_messages(self, message_ids):
        time.sleep(POLL)
        return [m for m in super().pull_messages(message_ids) if m.metadata.src_node_id != SILENT]


def test_a_node_that_never_replies_is_left_out_even_when_a_poll_outlasts_the_deadline():
    # Timeout 0.5 s: the third poll starts before the deadline and ends after it.
    grid = SlowGridWithASilentNode(client_app, [{"partition-id": i, "num-partitions": 2} for i in range(2)], run_id=5)
    exchanger = Exchanger(grid, 0.5, grid.run_id)
    with server_identity(grid.run_id):
        good = exchanger.round_trip({100: RecordDict(), SILENT: RecordDict()}, "query.info", 1)
    assert list(good) == [100]
    [failure] = exchanger.failures
    assert failure["node_id"] == SILENT and failure["reason"].startswith("no reply within")


class GridWithALateReply(EmptyReplies):
    """Node 100's reply is in 0.1 s after the push, but a poll takes longer than the round's
    timeout, so only a poll that starts after the deadline can see it."""

    def push_messages(self, messages):
        self.pushed = time.monotonic()
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        started = time.monotonic()
        time.sleep(0.7)
        return super().pull_messages(message_ids) if started - self.pushed > 0.1 else []


def test_a_reply_in_before_the_deadline_counts_even_when_a_poll_outlasts_it():
    grid = GridWithALateReply(client_app, [{"partition-id": 0, "num-partitions": 1}], run_id=5)
    exchanger = Exchanger(grid, 0.5, grid.run_id)
    with server_identity(grid.run_id):
        good = exchanger.round_trip({100: RecordDict()}, "query.info", 1)
    assert list(good) == [100] and not exchanger.failures


def half_uploaded(msg: Message) -> Message:
    """The error reply Flower's Grid makes when a reply's objects never all arrive."""
    reason = f"{flower_internals.HALF_UPLOADED}. The sender may not have completed the upload ..."
    return Message(Error(ErrorCode.MESSAGE_UNAVAILABLE, reason), reply_to=msg)


class GridWithAHalfUploadedReply(InProcessGrid):
    def _answer(self, msg: Message) -> Message:
        return half_uploaded(msg)


def test_a_reply_cut_off_mid_upload_is_named_as_such():
    grid = GridWithAHalfUploadedReply(client_app, [{"partition-id": 0, "num-partitions": 1}], run_id=5)
    exchanger = Exchanger(grid, 1.0, grid.run_id)
    with server_identity(grid.run_id):
        assert exchanger.round_trip({100: RecordDict()}, "query.info", 1) == {}
    [failure] = exchanger.failures
    assert failure["reason"] == "its reply was not completely uploaded within 1 s"


CUT = 101


class SuperLinkGrid(EmptyReplies, http_grid.HttpGrid):
    """Flower's deployment Grid against a SuperLink, as far as the exchange can tell (its class
    too, for `flower_internals.pull_replies`; the in-process Grid's methods come first): a poll
    takes the replies that are in off the SuperLink, then pulls their objects one reply after
    the other (through `http_grid`'s `pull_objects`), each reply's `upload` seconds after it
    starts on them; the SuperLink answers for a message whose reply another poll took, or whose
    time-to-live has passed, with a "not found" error. Taking replies off the SuperLink takes
    `rpc` seconds; a node's reply is in `late[node]` seconds after the push; node `CUT`'s objects
    never all arrive."""

    late: dict[int, float] = {}
    upload = rpc = 0.0

    def push_messages(self, messages):
        ids = super().push_messages(messages)  # each node answers here, as it is pushed
        self.pushed, self.sent = time.monotonic(), {m.metadata.message_id: m for m in messages}
        return ids

    def pull_messages(self, message_ids):
        time.sleep(self.rpc)
        age = time.monotonic() - self.pushed
        replies = []
        for i in message_ids:
            if age > self.sent[i].metadata.ttl or i not in self.replies:
                replies.append(Message(Error(ErrorCode.MESSAGE_UNAVAILABLE, "not found"), reply_to=self.sent[i]))
            elif age > self.late.get(self.sent[i].metadata.dst_node_id, 0.0):
                replies.append(self._pulled(self.replies.pop(i)))
        return replies

    def _pulled(self, reply):
        complete = math.inf if reply.metadata.src_node_id == CUT else time.monotonic() + self.upload

        def pull_object(object_id):
            if time.monotonic() < complete:
                raise inflatable_utils.ObjectUnavailableError(object_id)
            return b""

        try:
            http_grid.pull_objects(["a" * 64], pull_object, initial_backoff=0.01, backoff_cap=0.05)
        except inflatable_utils.ObjectPullError:
            return half_uploaded(self.sent[reply.metadata.reply_to_message_id])
        return reply


def _exchange(grid, timeout):
    exchanger = Exchanger(grid, timeout, grid.run_id)
    with server_identity(grid.run_id):
        good = exchanger.round_trip({100: RecordDict(), CUT: RecordDict()}, "query.info", 1)
    return good, {f["node_id"]: f["reason"] for f in exchanger.failures}


NODES = [{"partition-id": i, "num-partitions": 2} for i in range(2)]


class NodeCutOffMidUpload(SuperLinkGrid):
    late = {100: 0.2}


def test_a_node_cut_off_mid_upload_does_not_hold_up_the_replies_of_the_others():
    # The poll that takes CUT's reply waits for its objects until the deadline; before node
    # 100's reply comes in, later polls must run beside it, or its message expires unpulled.
    good, failed = _exchange(NodeCutOffMidUpload(client_app, NODES, run_id=5), 1.0)
    assert list(good) == [100] and failed == {CUT: "its reply was not completely uploaded within 1 s"}


class SlowPollsAndAFailingNode(SuperLinkGrid):
    """A poll takes 0.2 s and pulling a reply 0.1 s: the next poll starts while the one that took
    the replies pulls them, and is told "not found" for them after that one has returned them.
    Node `CUT` replies with an error of its own (its handler raised)."""

    rpc, upload = 0.2, 0.1

    def _answer(self, msg):
        if msg.metadata.dst_node_id == CUT:
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "injected fault"), reply_to=msg)
        return super()._answer(msg)

    def _pulled(self, reply):
        return reply if reply.has_error() else super()._pulled(reply)


def test_a_reply_or_a_nodes_own_error_beats_not_found_from_a_poll_beside_the_one_that_took_it():
    good, failed = _exchange(SlowPollsAndAFailingNode(client_app, NODES, run_id=5), 2.0)
    assert list(good) == [100] and failed == {
        CUT: f"error code {ErrorCode.CLIENT_APP_RAISED_EXCEPTION}: injected fault"
    }


def test_an_in_process_exchange_never_consults_the_guard_on_flower_internals(monkeypatch):
    def consulted():
        raise AssertionError("the guard was consulted")

    monkeypatch.setattr(flower_internals, "fast_path", consulted)
    monkeypatch.setattr(flower_internals, "mismatch", consulted)
    grid = EmptyReplies(client_app, NODES, run_id=5)
    exchanger = Exchanger(grid, 1.0, grid.run_id)
    with server_identity(grid.run_id):
        assert list(exchanger.round_trip({100: RecordDict(), 101: RecordDict()}, "query.info", 1)) == [100, 101]
    assert not exchanger.failures


class SlowUploads(SuperLinkGrid):
    """Both nodes' replies are in after 0.2 s, and their objects (CUT's too) take 0.1 s to pull."""

    late, rpc, upload = {100: 0.2, CUT: 0.2}, 0.05, 0.1

    def _pulled(self, reply):
        complete = time.monotonic() + self.upload

        def pull_object(object_id):
            if time.monotonic() < complete:
                raise inflatable_utils.ObjectUnavailableError(object_id)
            return b""

        http_grid.pull_objects(["a" * 64], pull_object, initial_backoff=0.01, backoff_cap=0.05)
        return reply


def test_off_the_fast_path_polls_over_the_deployment_grid_run_one_after_the_other_and_finish(monkeypatch, capsys):
    """Another Flower: the Grid's pulls are Flower's own, nothing says a poll has taken its
    replies, so each poll waits for the one before; the exchange still ends with every reply."""
    monkeypatch.setattr(flwr, "__version__", "1.39.1")
    flower_internals.forget()
    try:
        start = time.monotonic()
        good, failed = _exchange(SlowUploads(client_app, NODES, run_id=5), 60.0)
    finally:
        flower_internals.forget()
    # it finishes with the replies, not at the deadline; the bound leaves a loaded machine room
    assert list(good) == [100, CUT] and not failed and time.monotonic() - start < 30
    assert "florist: Flower 1.39.1 is installed" in capsys.readouterr().err


class CountingPushes(EmptyReplies):
    """Records how many messages each push carried, and the content objects they held."""

    def push_messages(self, messages):
        messages = list(messages)
        self.pushes = [*getattr(self, "pushes", []), len(messages)]
        self.kept = [*getattr(self, "kept", []), *(m.content for m in messages)]  # alive: no id is reused
        self.contents = {id(content) for content in self.kept}
        return super().push_messages(messages)


def test_a_local_grid_gets_its_messages_in_batches_and_a_shared_request_is_packed_once(monkeypatch):
    # 5 nodes, batches of 2: every node answers, in request order, and the failures of a silent
    # node are said once; the one request is packed once for all five.
    monkeypatch.setattr("florist.server.exchange.LOCAL_CHUNK", 2)
    nodes = [{"partition-id": i, "num-partitions": 5} for i in range(5)]
    grid = CountingPushes(client_app, nodes, run_id=5)
    exchanger, request = Exchanger(grid, 5.0, grid.run_id), RecordDict()
    with server_identity(grid.run_id):
        good = exchanger.round_trip({node: request for node in grid.get_node_ids()}, "query.info", 1)
    assert grid.pushes == [2, 2, 1] and len(grid.contents) == 1
    assert list(good) == grid.get_node_ids() and not exchanger.failures
    [exchange] = exchanger.take_exchanges()
    assert exchange["nodes"] == exchange["replies"] == 5
