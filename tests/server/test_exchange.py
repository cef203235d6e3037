"""The server's exchange with the nodes: a node that never replies is left out once the round's
timeout has passed, however long the polls themselves take."""

import time

from flwr.app import Error, Message, RecordDict
from flwr.common.constant import ErrorCode

from florist.client.app import app as client_app
from florist.common import flower_internals
from florist.server.inprocess import InProcessGrid, server_identity
from florist.server.strategy import Federation

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
    federation = Federation(grid, 0.5, grid.run_id)
    with server_identity(grid.run_id):
        good = federation.exchange({100: RecordDict(), SILENT: RecordDict()}, "query.info", 1)
    assert list(good) == [100]
    [failure] = federation.failures
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
    federation = Federation(grid, 0.5, grid.run_id)
    with server_identity(grid.run_id):
        good = federation.exchange({100: RecordDict()}, "query.info", 1)
    assert list(good) == [100] and not federation.failures


class GridWithAHalfUploadedReply(InProcessGrid):
    """The error reply Flower's Grid makes when a reply's objects never all arrive."""

    def _answer(self, msg: Message) -> Message:
        reason = f"{flower_internals.HALF_UPLOADED}. The sender may not have completed the upload ..."
        return Message(Error(ErrorCode.MESSAGE_UNAVAILABLE, reason), reply_to=msg)


def test_a_reply_cut_off_mid_upload_is_named_as_such():
    grid = GridWithAHalfUploadedReply(client_app, [{"partition-id": 0, "num-partitions": 1}], run_id=5)
    federation = Federation(grid, 1.0, grid.run_id)
    with server_identity(grid.run_id):
        assert federation.exchange({100: RecordDict()}, "query.info", 1) == {}
    [failure] = federation.failures
    assert failure["reason"] == "its reply was not completely uploaded within 1 s"
