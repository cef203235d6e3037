"""A SuperLink that serves its HTTP APIs to its own user only and refuses oversized gRPC messages.

Flower 1.39's SuperLink answers run submissions (Control API) and hands out a run's work
(Runtime API) on one HTTP port with no authentication: whoever can connect submits a run that
executes on the SuperLink and on every SuperNode. On 127.0.0.1 that is every user of the
machine. `owner_only` wraps the ASGI app the SuperLink serves (`flwr.superlink.main.create_app`)
so that a connection from the loopback is answered only when the socket at its other end
belongs to the SuperLink's own uid, which the kernel reports (netlink sock_diag: the uid that
made the socket, which another user cannot forge); anything else gets 403 and one log line.

Its gRPC servers (the Fleet API the SuperNodes dial) accept messages of up to 2 GiB: a party that
is not even a registered node makes it buffer that much per call. `limit_messages` has them made
with a receive (and send) limit instead (`flower_superlink.generic_create_grpc_server`), which gRPC
checks against a message's length prefix, before its body is read.

Both wrap code as Flower 1.39.0 wrote it (`problems`); where it reads otherwise, the caller runs
the stock SuperLink and says, in one line, what is then open.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

log = logging.getLogger("flwr").getChild(__name__)

NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST = 4, 20, 1  # linux/sock_diag.h, linux/netlink.h
UID_AT = 4 + 48 + 12  # inet_diag_msg: family, state, timer, retrans; its sockid; expires, queues; then uid
Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


def _flower_superlink() -> Any:
    """The module `flower-superlink` runs (its package exports a function of the same name)."""
    return importlib.import_module("flwr.superlink.cli.flower_superlink")


def problems() -> list[str]:
    """What the installed Flower lacks of what the two wrappers need (empty: both apply)."""
    try:
        from flwr.superlink import main

        flower_superlink = _flower_superlink()
    except ImportError as err:
        return [f"no SuperLink to run in this process ({err})"]
    found = [f"no {name} in flwr.superlink.main" for name in ("create_app",) if not hasattr(main, name)]
    found += [
        f"no {name} in flower_superlink"
        for name in ("flower_superlink", "generic_create_grpc_server", "_run_superlink_http_api")
        if not hasattr(flower_superlink, name)
    ]
    if found:
        return found
    from flwr.server.superlink.fleet.grpc_rere import fleet_servicer

    if not hasattr(fleet_servicer.FleetServicer, "RegisterNode"):
        return ["FleetServicer has no RegisterNode"]
    if "from flwr.superlink.main import" not in inspect.getsource(flower_superlink._run_superlink_http_api):
        found.append("_run_superlink_http_api no longer imports create_app when it runs")
    if "max_message_length" not in inspect.signature(flower_superlink.generic_create_grpc_server).parameters:
        found.append("generic_create_grpc_server has no max_message_length")
    return found


def _diag_request(family: int, local: tuple[str, int], remote: tuple[str, int]) -> bytes | None:
    """A netlink SOCK_DIAG_BY_FAMILY request for the one TCP socket of `family` bound to `local`
    and connected to `remote` (None: the addresses cannot be of that family)."""
    here, there = ipaddress.ip_address(local[0]), ipaddress.ip_address(remote[0])
    if family == socket.AF_INET:
        if here.version != 4 or there.version != 4:
            return None
        source, destination = here.packed + bytes(12), there.packed + bytes(12)
    else:  # a dual-stack socket shows an IPv4 peer as its IPv4-mapped IPv6 address

        def mapped(a: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bytes:
            return (ipaddress.IPv6Address(f"::ffff:{a}") if a.version == 4 else a).packed

        source, destination = mapped(here), mapped(there)
    # inet_diag_req_v2: family, protocol, extensions, pad, states (all); then inet_diag_sockid:
    # ports and addresses in network order, any interface, no cookie (the kernel finds the socket).
    sockid = struct.pack("!HH", int(local[1]), int(remote[1])) + source + destination
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    request += struct.pack("=III", 0, 0xFFFFFFFF, 0xFFFFFFFF)
    return struct.pack("=IHHII", 16 + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + request


def socket_owner(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The uid owning the TCP socket of this network namespace bound to `local` and connected to
    `remote` (None when there is none: it closed meanwhile). The kernel looks the socket up by
    its addresses (netlink sock_diag, about 40 µs; reading /proc/net/tcp walks the whole table, 4 ms)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        request = _diag_request(family, local, remote)
        if request is None:
            continue
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as netlink:
            netlink.settimeout(2.0)
            netlink.send(request)
            reply = netlink.recv(65536)
        if len(reply) >= 16 + UID_AT + 4 and struct.unpack_from("=H", reply, 4)[0] == SOCK_DIAG_BY_FAMILY:
            return struct.unpack_from("=I", reply, 16 + UID_AT)[0]
    return None


def can_see_owners() -> bool:
    """Whether this machine tells who owns a socket (Linux's netlink sock_diag)."""
    try:
        socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG).close()
    except (AttributeError, OSError):
        return False
    return True


def owner_only(app: ASGIApp, uid: int | None = None) -> ASGIApp:
    """`app`, answering HTTP and WebSocket connections from the loopback only when their socket
    belongs to `uid` (default: this process's). A connection from elsewhere is refused too: the
    SuperLink this guards listens on the loopback only."""
    uid = os.getuid() if uid is None else uid

    async def guarded(scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan: the SuperLink's own start and stop
            return await app(scope, receive, send)
        client, server = scope.get("client"), scope.get("server")
        owner = socket_owner(tuple(client), tuple(server)) if client and server else None
        if owner == uid:
            return await app(scope, receive, send)
        log.warning(
            "refused %s %s from %s: the SuperLink's HTTP APIs answer uid %d only, not %s",
            scope.get("method", "WebSocket"),
            scope.get("path", ""),
            f"{client[0]}:{client[1]}" if client else "an unknown peer",
            uid,
            "an unknown uid" if owner is None else f"uid {owner}",
        )
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = f'{{"detail": "this SuperLink answers uid {uid} only"}}'.encode()
        await send({"type": "http.response.start", "status": 403, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    return guarded


def serve_owner_only() -> None:
    """From here on, the SuperLink this process runs serves its HTTP APIs to this uid only."""
    from flwr.superlink import main

    create_app = main.create_app

    @functools.wraps(create_app)
    def guarded_app(*args: Any, **kwargs: Any) -> ASGIApp:
        return owner_only(create_app(*args, **kwargs))

    main.create_app = guarded_app


def limit_messages(max_bytes: int) -> None:
    """From here on, the gRPC servers the SuperLink of this process makes (its Fleet API) refuse
    messages over `max_bytes`, and send none larger."""
    flower_superlink = _flower_superlink()
    create = flower_superlink.generic_create_grpc_server

    @functools.wraps(create)
    def limited(*args: Any, **kwargs: Any) -> Any:
        return create(*args, **(kwargs | {"max_message_length": max_bytes}))

    flower_superlink.generic_create_grpc_server = limited
