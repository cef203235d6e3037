"""Exchanges with the nodes over Flower's Grid: one message per node out, one reply per node
back, with the round's timeout, replies mapped back to their node, failures logged and left out,
and the bytes each way counted from the records actually sent.

Every reply has a size cap (`Exchanger.reply_cap`, run-config key `max-reply-mb`). On the
deployment fast path the ServerApp stops pulling a reply's objects from the SuperLink once they
pass it (`flower_internals.pull_replies`); everywhere, a reply is weighed as its sender declared
it (`protocol.declared_nbytes`: its arrays' byte counts, nothing decoded or serialized) before
anything else is done with it, and one over its cap is refused. So off the fast path (stock
Flower, simulation, the in-process Grid) such a reply has been received whole, but is never
copied, decoded or checked value by value."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, as_completed, wait
from typing import Any

import grpc
import httpx
import torch
from flwr.app import Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from florist.common import flower_internals, packing, protocol
from florist.common.pacing import Backoff

# A child of Flower's logger, so messages reach `flwr run --stream` and the SuperLink log.
log = logging.getLogger("flwr").getChild(__name__)
# However late in its round, a reply that is in gets this long for its objects to be pulled.
MIN_PULL_SECONDS = 2.0
# With `max-reply-mb` 0, a reply may weigh twice what its exchange expects plus this: room for
# metrics, configs and .npy headers and, where an exchange does not say what it expects (its
# request's arrays stand in), for arrays its request does not show (PeFLL's encoder gradients
# answer a descriptor gradient). A 2 GB reply to a model of a few MB is refused all the same.
REPLY_SLACK = 64 * protocol.MB
# The reason given for a reply whose decoding raised what no check foresaw (the checks raise
# PackingError or ProtocolError, which say what is wrong); tests/test_fuzz.py expects never to see it.
UNDECODABLE = "its reply could not be decoded"
# Polls for replies (`Backoff`: floor, ratio): a SuperLink's, an HTTP request each, at least
# 50 ms apart and a tenth of the wait; the simulation's Grid, a lookup in this process's memory,
# 5 ms apart and a twentieth of the wait: on a round of 0.3 s (16 LeNet clients on 2 cores) the
# last reply then waits ~7 ms for its poll, not ~25 ms.
REMOTE_POLLS, LOCAL_POLLS = (0.05, 0.1), (0.005, 0.05)
# Nodes a Grid in this process gets messages for at once: 10,000 in-process clients' requests and
# replies no longer all exist together (discovery, the final evaluation), so the server's peak
# memory stops growing with the clients that exist. A deployment's nodes get theirs at once: a
# batch would wait out the timeout of any dead node in it, one batch after the other.
LOCAL_CHUNK = 1000
Expect = Mapping[str, Mapping[str, torch.Tensor]]  # per record of a reply, the arrays it should hold


class Exchanger:
    """Exchanges with the nodes: one message per node out, one reply per node back."""

    def __init__(self, grid: Grid, timeout: float, run_id: int = 0, max_reply_mb: float = 0.0):
        """`run_id`: what nodes key their state of this run by, sent in every message: the
        Flower run id of the run's first part, which a resumed run keeps. `max_reply_mb`
        (`max-reply-mb`): the cap on every reply, in MB; 0: each its own (`reply_cap`)."""
        self.grid, self.timeout, self.run_id, self.max_reply_mb = grid, timeout, run_id, max_reply_mb
        self.names: dict[int, str] = {}
        self.bytes_up = self.bytes_down = 0
        self.failures: list[dict[str, Any]] = []
        self.exchanges: list[
            dict[str, Any]
        ] = []  # per exchange: type, seconds, nodes, handler_seconds_max, data_seconds_max
        # record-level dp: what each node's replies since `take_record` said of its ε, and the latest of all
        self.record: dict[int, dict[str, float | str]] = {}
        self.record_latest: dict[int, dict[str, float | str]] = {}

    def name(self, node_id: int) -> str:
        return self.names.get(node_id, f"node {node_id}")

    def wait_for_nodes(self, count: int, timeout: float) -> list[int]:
        """Node ids once `count` nodes are connected; fails with a clear message after `timeout`."""
        deadline = time.monotonic() + timeout
        while len(nodes := sorted(self.grid.get_node_ids())) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(nodes)} of {count} nodes connected within {timeout:.0f} s; start more "
                    "SuperNodes or lower min-nodes"
                )
            time.sleep(0.5)
        return nodes

    def reply_cap(self, request: RecordDict, expect: Expect | None = None) -> int:
        """The most bytes a reply to `request` may weigh: `max-reply-mb` when it is set, else
        twice what the reply should hold (by `expect`; without it, the request's own arrays)
        plus `REPLY_SLACK`."""
        if self.max_reply_mb > 0:
            return int(self.max_reply_mb * protocol.MB)
        if expect is None:
            return 2 * protocol.array_nbytes(request) + REPLY_SLACK
        return 2 * sum(protocol.expected_nbytes(arrays) for arrays in expect.values()) + REPLY_SLACK

    def round_trip(
        self,
        requests: Mapping[int, RecordDict],
        message_type: str,
        server_round: int,
        expect: Expect | None = None,
    ) -> dict[int, RecordDict]:
        """Send `requests[node]` to each node and return the good replies by node id.

        A node that replies with an error, or not within the timeout, or with a reply over its
        cap (`reply_cap`, given `expect`: what the reply's records should hold), is logged,
        recorded in `failures`, and absent from the result: the round goes on with the others.
        """
        if not requests:
            return {}
        caps = {node: self.reply_cap(content, expect) for node, content in requests.items()}
        nodes, seconds = list(requests), 0.0
        good: dict[int, RecordDict] = {}
        failed: dict[int, str] = {}
        size = LOCAL_CHUNK if _in_memory(self.grid) else len(nodes)
        packed: dict[int, tuple[RecordDict, int]] = {}  # by id(content): its packed form and size, for every batch
        for first in range(0, len(nodes), size):
            part = {node: requests[node] for node in nodes[first : first + size]}
            part_good, part_failed, part_seconds = self._exchange(part, message_type, server_round, caps, packed)
            good |= part_good
            failed |= part_failed
            seconds += part_seconds
        for node, reason in failed.items():
            self.fail(node, message_type, server_round, reason)
        slowest = {
            part: round(max((protocol.handler_seconds(r, part) for r in good.values()), default=0.0), 4)
            for part in ("handler", "data")
        }
        self.exchanges.append(
            {
                "type": message_type,
                "seconds": round(seconds, 4),
                "nodes": len(requests),
                "replies": len(good),
                "handler_seconds_max": slowest["handler"],
                "data_seconds_max": slowest["data"],
            }
        )
        for node, reply in good.items():  # record-level dp: the node's ε after the steps of this message
            if (said := protocol.record_dp_of(reply)) is not None:
                self.record[node] = self.record_latest[node] = said
        # In request order, not arrival order (which varies): float sums over replies then repeat exactly.
        return {node: good[node] for node in requests if node in good}

    def _exchange(
        self,
        requests: Mapping[int, RecordDict],
        message_type: str,
        server_round: int,
        caps: Mapping[int, int],
        packed: dict[int, tuple[RecordDict, int]],
    ) -> tuple[dict[int, RecordDict], dict[int, str], float]:
        """One batch of `round_trip`: its good replies by node, the reason each other node
        failed, and the seconds it waited for them. A content sent to several nodes is packed
        and weighed once over all batches (`packed`, by id of a content `requests` holds alive)."""
        for content in requests.values():
            if id(content) not in packed:
                packed[id(content)] = (form := packing.pack(content), protocol.nbytes(form))
        # The time-to-live is the round timeout: a handler still running after it is stopped (client/deadline.py).
        messages = [
            Message(
                packed[id(content)][0],
                dst_node_id=node,
                message_type=message_type,
                group_id=str(server_round),
                ttl=self.timeout,
            )
            for node, content in requests.items()
        ]
        self.bytes_down += sum(packed[id(content)][1] for content in requests.values())
        start = time.monotonic()
        replies = self._send_and_receive(messages, max(caps[node] for node in requests))
        seconds = time.monotonic() - start
        # Reply ids are known only after sending; errors made by the SuperLink carry its id, not the node's.
        good, failed = self._sort(replies, {m.metadata.message_id: m.metadata.dst_node_id for m in messages}, caps)
        for node in sorted(set(requests) - set(good) - set(failed)):
            failed[node] = f"no reply within {self.timeout:.0f} s"
        for node in failed:
            good.pop(node, None)
        return good, failed, seconds

    def _sort(
        self, replies: list[Message], sent_to: dict[str, int], caps: Mapping[int, int]
    ) -> tuple[dict[int, RecordDict], dict[int, str]]:
        """The good replies' contents by node, and the first reason each other node failed for
        (`sent_to`: the node each sent message id went to; `caps`: each node's reply cap, in
        bytes, checked before anything else is done with a reply)."""
        good: dict[int, RecordDict] = {}
        failed: dict[int, str] = {}
        for reply in replies:
            node = sent_to.get(reply.metadata.reply_to_message_id)
            try:
                if reply.has_error():
                    node = reply.metadata.src_node_id if node is None else node
                    reason = self._error_reason(reply)
                elif node != reply.metadata.src_node_id:  # never taken for another node's reply, or a stale one
                    node = reply.metadata.src_node_id
                    reason = (
                        f"it replied to message {reply.metadata.reply_to_message_id!r}, not one this exchange sent it"
                    )
                elif node in good:
                    reason = "more than one reply to its message"
                else:
                    good[node] = self._unpacked(reply, node, caps[node])
                    continue
            except packing.PackingError as err:
                reason = str(err)
            except Exception as err:  # what no check foresaw: at worst, a reply leaves its own node out
                node = reply.metadata.src_node_id if node is None else node
                log.debug("the reply of %s raised", self.name(node), exc_info=True)
                reason = f"{UNDECODABLE} ({type(err).__name__}: {protocol.one_line(str(err), 100)})"
            failed.setdefault(node, reason)
        return good, failed

    def _unpacked(self, reply: Message, node: int, cap: int) -> RecordDict:
        """`node`'s reply, weighed as declared before anything else is done with it (PackingError
        when over `cap`), then counted and unpacked."""
        if (size := protocol.declared_nbytes(reply.content)) > cap:
            self.bytes_up += size
            raise packing.PackingError(f"its reply of {_mb(size)} is over its cap of {_mb(cap)} (max-reply-mb)")
        self.bytes_up += protocol.nbytes(reply.content)
        return packing.unpack(reply.content, self.name(node))

    def _error_reason(self, reply: Message) -> str:
        """Why an error reply says its node failed, in words: its code and reason as sent, cut
        and cleaned (`protocol.one_line`) before anything copies them."""
        code, reason = reply.error.code, reply.error.reason
        if code != ErrorCode.MESSAGE_UNAVAILABLE:
            prefix = f"error code {protocol.one_line(code, 24)}: "
            return prefix + protocol.one_line(reason, protocol.REASON_CHARS - len(prefix))
        error = Error(code, protocol.one_line(reason, 1000))  # ours are short; a node's may not be
        if (sizes := flower_internals.oversized(error)) is not None:  # made by the deployment Grid
            pulled, cap = sizes  # what it weighed when the pull stopped
            return f"its reply is over its cap of {_mb(cap)} (max-reply-mb): {_mb(pulled)} or more, no more pulled"
        if flower_internals.half_uploaded(error):  # made by the deployment Grid
            return f"its reply was not completely uploaded within {self.timeout:.0f} s"
        return f"no reply within {self.timeout:.0f} s (the message expired)"  # its time-to-live, the timeout, ran out

    def _send_and_receive(self, messages: list[Message], cap: int) -> list[Message]:
        """Like `Grid.send_and_receive`, but polling with a `Backoff` instead of Flower's fixed
        3 s (a quick reply is seen within tens of milliseconds, a slow one costs few polls), and
        with each poll in a thread of its own: a poll that took the reply of a node cut off
        mid-upload waits for its objects until the deadline, while the next polls, which start
        once it has taken its replies off the SuperLink, collect the other nodes' replies.
        (Off the fast path, and with any other Grid, a poll never says it has taken its replies:
        polls then run one after the other, each as Flower's `pull_messages` runs.) On the fast
        path no reply's objects are pulled beyond `cap` bytes; off it, replies come whole."""
        try:
            pending = set(self.grid.push_messages(messages))
        except (httpx.HTTPError, grpc.RpcError) as err:  # Flower's grid raises its transport's errors as they come
            raise RuntimeError(
                f"the SuperLink did not take {len(messages)} message(s) ({err}); its log says why (it refuses one "
                f"that expired on the way: is round-timeout, {self.timeout:g} s, long enough?)"
            ) from err
        floor, ratio = LOCAL_POLLS if _in_memory(self.grid) else REMOTE_POLLS
        deadline, backoff = time.monotonic() + self.timeout, Backoff(floor=floor, cap=0.5, ratio=ratio)
        replies: list[Message] = []

        def collect(poll: Future[list[Message]]) -> None:
            replies.extend(pulled := poll.result())
            pending.difference_update(m.metadata.reply_to_message_id for m in pulled)

        def poll(ids: list[str], taken: threading.Event) -> list[Message]:
            return flower_internals.pull_replies(self.grid, ids, deadline, MIN_PULL_SECONDS, taken.set, cap)

        pool = ThreadPoolExecutor(thread_name_prefix="florist-poll")
        polls: dict[Future[list[Message]], threading.Event] = {}  # set once the poll has taken its replies
        try:
            while pending and (now := time.monotonic()) < deadline:
                if all(taken.is_set() for taken in polls.values()):  # none is still taking replies
                    taken = threading.Event()
                    polls[pool.submit(poll, sorted(pending), taken)] = taken
                due = min(now + backoff.delay(), deadline)
                while pending and (left := due - time.monotonic()) > 0:
                    if not polls:
                        time.sleep(left)
                        break
                    for done in wait(polls, left, FIRST_COMPLETED).done:
                        polls.pop(done)
                        collect(done)
            for done in as_completed(polls):  # each gives up on its objects by the deadline
                collect(done)
        finally:  # after an error (or Ctrl-C) a poll still waiting for objects is not waited for
            pool.shutdown(wait=False, cancel_futures=True)
        if pending:  # a last poll, after the deadline: a reply in by then counts
            replies += flower_internals.pull_replies(self.grid, sorted(pending), deadline, MIN_PULL_SECONDS, cap=cap)
        return _telling(replies)

    def fail(self, node: int, message_type: str, server_round: int, reason: str) -> None:
        """Record that `node` dropped out of this exchange, and say so in the log. Every failure
        passes here, so `reason` is made one short printable line here (`protocol.one_line`):
        a node may write it, and the log, results.json, report.md and checkpoints keep it."""
        reason = protocol.one_line(reason)
        log.warning("%s left out of %s in round %d: %s", self.name(node), message_type, server_round, reason)
        self.failures.append(
            {
                "round": server_round,
                "node_id": node,
                "node": self.name(node),
                "message_type": message_type,
                "reason": reason,
            }
        )

    def take_bytes(self) -> tuple[int, int]:
        """(bytes up, bytes down) since the last call."""
        counts = (self.bytes_up, self.bytes_down)
        self.bytes_up = self.bytes_down = 0
        return counts

    def take_record(self) -> dict[int, dict[str, float | str]]:
        """What the nodes said of their record-level dp since the last call, by node id."""
        said, self.record = self.record, {}
        return said

    def take_exchanges(self) -> list[dict[str, Any]]:
        """The exchanges since the last call."""
        exchanges, self.exchanges = self.exchanges, []
        return exchanges


def _in_memory(grid: Grid) -> bool:
    """Whether `grid` holds the messages in this process's memory: the simulation's, or the
    in-process runtime's (which says so: `in_process`)."""
    from flwr.superlink.grid import InMemoryGrid

    return isinstance(grid, InMemoryGrid) or getattr(grid, "in_process", False)


def _mb(size: int) -> str:
    return f"{size / protocol.MB:.1f} MB"


def _telling(replies: list[Message]) -> list[Message]:
    """`replies` without the errors that say less than another answer to the same message.
    The SuperLink answers a poll that asks for a reply another poll took as it answers one for
    a message that expired: "not found". So a reply beats any error for its message, and any
    other error, the node's own or a half upload, beats "not found"."""
    answered = {m.metadata.reply_to_message_id for m in replies if not m.has_error()}
    errors: dict[str, Message] = {}  # per message without a reply, its most telling error
    for m in replies:
        if m.has_error() and (key := m.metadata.reply_to_message_id) not in answered:
            if key not in errors or (_not_found(errors[key]) and not _not_found(m)):
                errors[key] = m
    return [m for m in replies if not m.has_error()] + list(errors.values())


def _not_found(reply: Message) -> bool:
    """Whether `reply` is the SuperLink's error for a message it no longer has (expired, or its
    reply taken by another poll), not the node's error or the Grid's for a half upload."""
    return reply.error.code == ErrorCode.MESSAGE_UNAVAILABLE and not flower_internals.half_uploaded(reply.error)
