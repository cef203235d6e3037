"""The server's exchange with the nodes: a node that never replies is left out once the round's
timeout has passed, however long the polls themselves take."""

import time

from flwr.app import Message, RecordDict

from florist.client.app import app as client_app
from florist.server.inprocess import InProcessGrid, server_identity
from florist.server.strategy import Federation

SILENT, POLL = 101, 0.3


class SlowGridWithASilentNode(InProcessGrid):
    """Every node but `SILENT` replies at once with an empty content; every poll takes `POLL`
    seconds, as pulls from a busy SuperLink over TLS can."""

    def _answer(self, msg: Message) -> Message:
        return Message(RecordDict(), reply_to=msg)

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
