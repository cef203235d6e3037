"""Registrations an anonymous party cannot use to fill a SuperLink.

Without node authentication, Flower 1.39's Fleet API registers any public key anyone sends, keeps
every one, and logs each refusal quoting the key in full: 20,000 registrations grew a SuperLink
from 138 to 323 MiB with no cap, and one refused duplicate wrote 11.5 KB of log. `guard` wraps
`FleetServicer.RegisterNode` so that a key larger than a real one (`MAX_PUBLIC_KEY`), a remote
address over its rate (the loopback is this machine's own nodes, which start side by side), or a
registration beyond `max_nodes` is refused before Flower stores anything, the refusals tallied in
one log line a minute; at the cap, registrations that never connected (still "registered" after
`expire_seconds`) are removed first. `OneLineRemote` cuts every Fleet log line, which may quote
what a remote party sent, to one line of at most `LOG_CHARS` characters.
"""

from __future__ import annotations

import collections
import datetime
import functools
import ipaddress
import logging
import math
import threading
import time
import types
from typing import Any

log = logging.getLogger("flwr").getChild(__name__)

# Flower's SuperNode registers its EC public key as PEM SubjectPublicKeyInfo (measured with the
# cryptography package: P-384 215 bytes, P-521 268, Ed25519 113; RSA-4096, which Flower's node
# auth does not take, 800): twice the largest EC one leaves room for any other encoding of it.
MAX_PUBLIC_KEY = 512
LOG_CHARS = 300
# At the cap, the nodes are counted again (and the stale ones expired) at most this often: a full
# count reads every node, which a flood of refused calls must not make it do per call.
RECOUNT_SECONDS = 2.0
PEERS = 65_536  # peers whose rate is remembered; the longest idle ones are forgotten first


class PeerRate:
    """A token bucket per peer address: `per_minute` registrations, refilled evenly."""

    def __init__(self, per_minute: float, clock=time.monotonic):
        self.per_minute, self.clock = per_minute, clock
        self.buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()
        self.lock = threading.Lock()

    def take(self, peer: str) -> bool:
        """Whether `peer` may register now (and one of its tokens is spent)."""
        now = self.clock()
        with self.lock:
            tokens, then = self.buckets.pop(peer, (self.per_minute, now))
            tokens = min(self.per_minute, tokens + (now - then) * self.per_minute / 60)
            allowed = tokens >= 1
            self.buckets[peer] = (tokens - allowed, now)
            while len(self.buckets) > PEERS:
                self.buckets.popitem(last=False)
            return allowed


class Tally:
    """Refusals said in the log at most once per `every` seconds, with how many there were: a
    flood of refused calls adds a line a minute, not one per call."""

    def __init__(self, every: float = 60.0, clock=time.monotonic):
        self.every, self.clock, self.count, self.said = every, clock, 0, -math.inf

    def refused(self, why: str) -> None:
        self.count += 1
        if self.clock() - self.said >= self.every:
            log.warning("%d registrations refused since the last such line: %s", self.count, why)
            self.count, self.said = 0, self.clock()


def address(peer: str) -> str:
    """A gRPC peer (`ipv4:1.2.3.4:5678`, `ipv6:[::1]:5678`) without its port: the party's address."""
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


def guard(max_nodes: int, per_minute: float, expire_seconds: float) -> None:
    """From here on, the Fleet API refuses what `RegisterNode` must not store (module docstring)."""
    import grpc
    from flwr.server.superlink.fleet.grpc_rere import fleet_servicer
    from flwr.supercore.constant import NodeStatus

    register, rate, tally = fleet_servicer.FleetServicer.RegisterNode, PeerRate(per_minute), Tally()
    lock = threading.Lock()
    count = types.SimpleNamespace(live=None, at=-math.inf)  # nodes held, counted in full only at the cap

    @functools.wraps(register)
    def bounded(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        if len(request.public_key) > MAX_PUBLIC_KEY:
            size = len(request.public_key)
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a public key of {size} bytes; SuperNode keys are at most {MAX_PUBLIC_KEY}",
            )
        peer = address(context.peer())
        if not _loopback(peer) and not rate.take(peer):  # this machine's own nodes start side by side
            with lock:
                tally.refused(f"over {per_minute:g} a minute from one address")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"over {per_minute:g} registrations a minute from here")
        with lock:  # counted and registered together: concurrent calls cannot pass the cap side by side
            if count.live is None or (count.live >= max_nodes and time.monotonic() - count.at >= RECOUNT_SECONDS):
                state = self.state_factory.state()
                live = state.get_node_info(statuses=[NodeStatus.REGISTERED, NodeStatus.ONLINE, NodeStatus.OFFLINE])
                expired = expire(state, live, expire_seconds) if len(live) >= max_nodes else 0
                count.live, count.at = len(live) - expired, time.monotonic()
            if count.live >= max_nodes:
                tally.refused(f"the SuperLink holds its --max-nodes {max_nodes}")
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the SuperLink holds its {max_nodes} nodes")
            response = register(self, request, context)
            count.live += 1
            return response

    fleet_servicer.FleetServicer.RegisterNode = bounded


def _loopback(peer: str) -> bool:
    host = peer.partition(":")[2].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return peer.startswith("unix:")
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def expire(state: Any, nodes: Any, seconds: float) -> int:
    """Remove the registrations among `nodes` that never connected within `seconds` of
    registering; how many, said in the log."""
    from flwr.supercore.constant import NodeStatus

    cutoff = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds)
    stale = [n for n in nodes if n.status == NodeStatus.REGISTERED and _when(n.registered_at) < cutoff]
    for node in stale:
        state.delete_node(node.owner_aid, node.node_id)
    if stale:
        log.info("removed %d registrations that never connected within %g s", len(stale), seconds)
    return len(stale)


def _when(iso: str) -> datetime.datetime:
    when = datetime.datetime.fromisoformat(iso)
    return when if when.tzinfo else when.replace(tzinfo=datetime.UTC)


class OneLineRemote(logging.Filter):
    """Flower's Fleet API logs refusals quoting what the remote party sent (a whole public key,
    several times over): those lines (`[Fleet.…]`, `[…][ApiError…]`) are cut to one line of at
    most `LOG_CHARS` characters, so the log grows by at most that per call."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if text.startswith("[") and ("Fleet" in text[:40] or "Error:" in text[:60]):
            text = " ".join(text.split())
            record.msg, record.args = (text if len(text) <= LOG_CHARS else text[: LOG_CHARS - 1] + "…"), None
            record.exc_info = record.exc_text = None
        return True
