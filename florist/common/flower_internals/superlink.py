"""A SuperLink that serves its HTTP APIs to its own user only and refuses oversized gRPC messages.

Flower 1.39's SuperLink answers run submissions (Control API) and hands out a run's work
(Runtime API) on one HTTP port with no authentication: whoever can connect submits a run that
executes on the SuperLink and on every SuperNode. On 127.0.0.1 that is every user of the
machine. `owner_only` wraps the ASGI app the SuperLink serves (`flwr.superlink.main.create_app`)
so that a connection from the loopback is answered only when the socket at its other end
belongs to the SuperLink's own uid, which the kernel reports in /proc/net/tcp{,6} (the uid
that made the socket: another user cannot forge it); anything else gets 403 and one log line.

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
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

log = logging.getLogger("flwr").getChild(__name__)

TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
# The largest public key a SuperNode may register: an ECDSA P-384 key in OpenSSH form is about
# 200 bytes, an RSA-4096 one about 750. Flower stores any it is sent, and quotes it in full.
MAX_PUBLIC_KEY = 4096
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


def _address(hexed: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """An address of /proc/net/tcp{,6} (host-order 32-bit words in hex, then the port), with an
    IPv4-mapped IPv6 address given as the IPv4 address it maps."""
    host, port = hexed.split(":")
    raw = bytes.fromhex(host)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return address, int(port, 16)


def _normal(host: str, port: int) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    address = ipaddress.ip_address(host)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return address, int(port)


def socket_owner(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The uid owning the TCP socket of this network namespace bound to `local` and connected to
    `remote` (None when there is none: it closed meanwhile)."""
    want = (_normal(*local), _normal(*remote))
    for table in TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if (_address(fields[1]), _address(fields[2])) == want:
                return int(fields[7])
    return None


def can_see_owners() -> bool:
    """Whether this machine reports who owns a socket (Linux's /proc/net/tcp)."""
    return TABLES[0].exists()


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


def limit_public_keys(max_bytes: int = MAX_PUBLIC_KEY) -> None:
    """From here on, the Fleet API refuses to register a public key over `max_bytes` (insecure
    SuperLinks let anyone register: without this, each call could store a key the size of the
    message limit, and Flower keeps every one)."""
    import grpc
    from flwr.server.superlink.fleet.grpc_rere import fleet_servicer

    register = fleet_servicer.FleetServicer.RegisterNode

    @functools.wraps(register)
    def bounded(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        if len(request.public_key) > max_bytes:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a public key of {len(request.public_key)} bytes; SuperNode keys are at most {max_bytes}",
            )
        return register(self, request, context)

    fleet_servicer.FleetServicer.RegisterNode = bounded
