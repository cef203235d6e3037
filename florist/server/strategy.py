"""The small base every algorithm's server half stands on.

`Federation` wraps Flower's Grid with what every exchange needs: a timeout, replies mapped
back to their node, failures logged and left out, and the bytes each way counted from the
records actually sent. `Strategy` holds the run's settings and the round skeleton; a round is
any number of exchanges (`Federation.exchange`), so multi-message algorithms fit the same
mould as FedAvg.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, as_completed, wait
from typing import Any, NamedTuple

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from florist.algorithms.base import Exchange
from florist.common import devices, flower_internals, packing, protocol
from florist.common.config import RunConfig
from florist.common.metrics import weighted_mean
from florist.common.models import Net, seeded_model
from florist.common.pacing import Backoff

# A child of Flower's logger, so messages reach `flwr run --stream` and the SuperLink log.
log = logging.getLogger("flwr").getChild(__name__)
# However late in its round, a reply that is in gets this long for its objects to be pulled.
MIN_PULL_SECONDS = 2.0


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """What a node told the server about itself at the start of the run."""

    node_id: int
    key: str
    seen: bool
    num_train: int
    num_test: int
    input_shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"node {self.node_id} ({self.key})"


class Federation:
    """Exchanges with the nodes: one message per node out, one reply per node back."""

    def __init__(self, grid: Grid, timeout: float, run_id: int = 0):
        """`run_id`: what nodes key their state of this run by, sent in every message: the
        Flower run id of the run's first part, which a resumed run keeps."""
        self.grid, self.timeout, self.run_id = grid, timeout, run_id
        self.names: dict[int, str] = {}
        self.bytes_up = self.bytes_down = 0
        self.failures: list[dict[str, Any]] = []
        self.exchanges: list[
            dict[str, Any]
        ] = []  # per exchange: type, seconds, nodes, handler_seconds_max, data_seconds_max

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

    def exchange(
        self, requests: Mapping[int, RecordDict], message_type: str, server_round: int
    ) -> dict[int, RecordDict]:
        """Send `requests[node]` to each node and return the good replies by node id.

        A node that replies with an error, or not within the timeout, is logged, recorded in
        `failures`, and absent from the result: the round goes on with the others.
        """
        if not requests:
            return {}
        # The time-to-live is the round timeout: a handler still running after it is stopped (client/deadline.py).
        messages = [
            Message(
                packing.pack(content),
                dst_node_id=node,
                message_type=message_type,
                group_id=str(server_round),
                ttl=self.timeout,
            )
            for node, content in requests.items()
        ]
        self.bytes_down += sum(protocol.nbytes(m.content) for m in messages)
        start = time.monotonic()
        replies = self._send_and_receive(messages)
        seconds = time.monotonic() - start
        # Reply ids are known only after sending; errors made by the SuperLink carry its id, not the node's.
        sent_to = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
        good: dict[int, RecordDict] = {}
        failed: dict[int, str] = {}  # the first reason each node failed for
        for reply in replies:
            node = sent_to.get(reply.metadata.reply_to_message_id)
            if reply.has_error():
                node = reply.metadata.src_node_id if node is None else node
                reason = f"error code {reply.error.code}: {reply.error.reason}"
                if reply.error.code == ErrorCode.MESSAGE_UNAVAILABLE:  # its time-to-live, the timeout, ran out
                    reason = f"no reply within {self.timeout:.0f} s (the message expired)"
                    if reply.error.reason.startswith(flower_internals.HALF_UPLOADED):  # made by the Grid
                        reason = f"its reply was not completely uploaded within {self.timeout:.0f} s"
            elif node != reply.metadata.src_node_id:  # never taken for another node's reply, or a stale one
                node = reply.metadata.src_node_id
                reason = f"it replied to message {reply.metadata.reply_to_message_id!r}, not one this exchange sent it"
            elif node in good:
                reason = "more than one reply to its message"
            else:
                self.bytes_up += protocol.nbytes(reply.content)
                try:
                    good[node] = packing.unpack(reply.content, self.name(node))
                    continue
                except packing.PackingError as err:
                    reason = str(err)
            failed.setdefault(node, reason)
        for node in sorted(set(requests) - set(good) - set(failed)):
            failed[node] = f"no reply within {self.timeout:.0f} s"
        for node, reason in failed.items():
            good.pop(node, None)
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
                "handler_seconds_max": slowest["handler"],
                "data_seconds_max": slowest["data"],
            }
        )
        # In request order, not arrival order (which varies): float sums over replies then repeat exactly.
        return {node: good[node] for node in requests if node in good}

    def _send_and_receive(self, messages: list[Message]) -> list[Message]:
        """Like `Grid.send_and_receive`, but polling with a `Backoff` instead of Flower's fixed
        3 s (a quick reply is seen within tens of milliseconds, a slow one costs few polls), and
        with each poll in a thread of its own: a poll that took the reply of a node cut off
        mid-upload waits for its objects until the deadline, while the next polls, which start
        once it has taken its replies off the SuperLink, collect the other nodes' replies."""
        pending = set(self.grid.push_messages(messages))
        deadline, backoff = time.monotonic() + self.timeout, Backoff(floor=0.05, cap=0.5, ratio=0.1)
        replies: list[Message] = []

        def collect(poll: Future[list[Message]]) -> None:
            replies.extend(pulled := poll.result())
            pending.difference_update(m.metadata.reply_to_message_id for m in pulled)

        def poll(ids: list[str], taken: threading.Event) -> list[Message]:
            return flower_internals.pull_replies(self.grid, ids, deadline, MIN_PULL_SECONDS, taken.set)

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
            replies += flower_internals.pull_replies(self.grid, sorted(pending), deadline, MIN_PULL_SECONDS)
        return _telling(replies)

    def fail(self, node: int, message_type: str, server_round: int, reason: str) -> None:
        """Record that `node` dropped out of this exchange, and say so in the log."""
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

    def take_exchanges(self) -> list[dict[str, Any]]:
        """The exchanges since the last call."""
        exchanges, self.exchanges = self.exchanges, []
        return exchanges


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
    return reply.error.code == ErrorCode.MESSAGE_UNAVAILABLE and not reply.error.reason.startswith(
        flower_internals.HALF_UPLOADED
    )


class Reply(NamedTuple):
    """A node's checked reply: its metrics, its arrays (the model) and its `side` arrays
    (anything else it sends beside the model), each when the exchange expects them."""

    metrics: dict[str, float]
    arrays: dict[str, torch.Tensor]
    side: dict[str, torch.Tensor] = {}


TRAINED = ("num-examples", "train-loss")  # metrics every training reply carries
TESTED = ("accuracy", "num-examples")  # metrics every evaluation reply carries


class Strategy:
    """A personalization algorithm's server half.

    Subclasses implement `train_round` (any number of exchanges) and `evaluate` (per-node
    metrics with at least `accuracy` and `num-examples`); `serve` gives nodes that never trained
    their personalized model (by default through `evaluate`). `self.settings` is the
    algorithm's own section of the run config.
    """

    def __init__(self, cfg: RunConfig, federation: Federation, input_shape: tuple[int, ...], num_seen: int):
        """`num_seen`: how many nodes train (some algorithms size their networks by it)."""
        self.cfg, self.federation, self.input_shape, self.num_seen = cfg, federation, input_shape, num_seen
        self.settings: Any = cfg.settings
        # Where the server half's own networks train (`server-device`); what it sends and saves stays on the CPU.
        self.device = devices.resolve(cfg.server_device, "server-device")

    def new_model(self) -> Net:
        """The run's model, seeded: clients that build it from the same seed get the same weights."""
        return seeded_model(self.cfg.model, self.input_shape, self.cfg.num_classes, self.cfg.seed)

    def sample_size(self, available: int) -> int:
        """How many nodes a round trains: `fraction-train` of them, at least `min-train-nodes`."""
        return min(available, max(self.cfg.min_train_nodes, math.ceil(self.cfg.fraction_train * available)))

    def sample(self, nodes: list[NodeInfo], server_round: int) -> list[NodeInfo]:
        """`sample_size` nodes drawn uniformly without replacement, seeded by the round."""
        rng = np.random.default_rng([self.cfg.seed, server_round])
        return [nodes[i] for i in sorted(rng.choice(len(nodes), self.sample_size(len(nodes)), replace=False))]

    def request(
        self,
        exchange: Exchange,
        server_round: int,
        arrays: ArrayRecord | None = None,
        side: ArrayRecord | None = None,
        **values: Any,
    ) -> RecordDict:
        """A request of `exchange`: the records, the settings that travel, and the exchange's
        own settings `values` (checked against its declared `request` dataclass)."""
        config = message_config(self.cfg, exchange, server_round, self.federation.run_id, **values)
        return protocol.content(arrays, config, side=side)

    def ask(
        self,
        exchange: Exchange,
        requests: Mapping[int, RecordDict],
        server_round: int,
        required: tuple[str, ...],
        reference: Mapping[str, torch.Tensor] | None = None,
        side: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[int, Reply]:
        """Send `requests[node]` to each node; return, by node, the replies whose `metrics`
        carry the `required` ones and, when a `reference` (or `side`) is given, whose `arrays`
        (or `side` arrays) match it: keys, shapes, finite values. Any other reply is recorded
        as a failure."""
        good: dict[int, Reply] = {}
        message_type = exchange.message_type
        for node, content in self.federation.exchange(requests, message_type, server_round).items():
            name = self.federation.name(node)
            try:
                metrics = protocol.metrics_of(content, required, name)
                arrays = {} if reference is None else protocol.arrays_of(content, reference, name)
                extra = {} if side is None else protocol.arrays_of(content, side, name, protocol.SIDE)
            except protocol.ProtocolError as err:
                self.federation.fail(node, message_type, server_round, str(err))
                continue
            good[node] = Reply(metrics, arrays, extra)
        return good

    def broadcast(
        self,
        exchange: Exchange,
        nodes: list[NodeInfo],
        server_round: int,
        content: RecordDict,
        required: tuple[str, ...],
        reference: Mapping[str, torch.Tensor] | None = None,
        side: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[int, Reply]:
        """`ask` with the same `content` for every node."""
        return self.ask(exchange, {n.node_id: content for n in nodes}, server_round, required, reference, side)

    def train_round(self, server_round: int, nodes: list[NodeInfo]) -> float | None:
        """Run one training round with `nodes`; return the mean training loss (None if none)."""
        raise NotImplementedError

    def evaluate(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        """Per-node test metrics of each node's (personalized) model."""
        raise NotImplementedError

    def serve(self, server_round: int, nodes: list[NodeInfo]) -> dict[int, dict[str, float]]:
        """The serve phase: personalize and score nodes that took no part in training (held-out
        clients, or nodes that joined afterwards). No training happens on any side beyond what
        the strategy's personalization itself does; by default that is its evaluation."""
        return self.evaluate(server_round, nodes)

    # Attributes with `state_dict()` / `load_state_dict()` (networks, optimizers) that make up
    # the server's state; `state` and `load_state` add anything else a subclass keeps.
    checkpointed: tuple[str, ...] = ()

    def state(self) -> dict[str, Any]:
        """Everything the server half needs to go on from here (checkpointed after every round):
        tensors, dicts, lists and numbers only, so that a checkpoint loads without pickle."""
        return {name: getattr(self, name).state_dict() for name in self.checkpointed}

    def load_state(self, state: dict[str, Any]) -> None:
        """Go on from a `state()` saved by an earlier process of the same run."""
        for name in self.checkpointed:
            getattr(self, name).load_state_dict(state[name])

    def round_extras(self) -> dict[str, Any]:
        """Figures of the last training round to keep in its results row beside the standard
        ones (e.g. what FedAvg would have sent instead)."""
        return {}


def message_config(cfg: RunConfig, exchange: Exchange, server_round: int, run_id: int, **values: Any) -> dict[str, Any]:
    """A request's `config` record: the run's settings that travel (the common ones and the
    strategy's section), the round and run id, and the exchange's own settings, by its dataclass."""
    own = exchange.request(**values).to_mapping()
    return cfg.to_mapping(travelling=True) | {"server-round": server_round, "run-id": run_id} | own


def metrics_of(replies: Mapping[int, Reply]) -> dict[int, dict[str, float]]:
    """The metrics of each node's reply (what `evaluate` and `serve` return)."""
    return {node: reply.metrics for node, reply in replies.items()}


def mean_loss(metrics: Iterable[Mapping[str, float]]) -> float | None:
    """Example-weighted mean of `train-loss` over replies (None when there are none)."""
    rows = list(metrics)
    if not rows:
        return None
    return weighted_mean([m["train-loss"] for m in rows], [m["num-examples"] for m in rows])
