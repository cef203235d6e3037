"""`florist superlink`: Flower's SuperLink, run in this process, guarded where Flower 1.39 is open.

- Its HTTP APIs (Control: run submission, node registration; Runtime: a run's tasks), when they
  listen on the loopback, answer only this user's connections (`serve_owner_only`): no other
  user of the machine can submit a run, which would execute on the SuperLink and every SuperNode.
  Listening elsewhere (docker compose: an address on a network of its own) they are as open as
  that network, and it says so in one line.
- Its gRPC servers (the Fleet API) refuse a message over `--max-message-mb` from its length
  prefix, before reading the body (`limit_messages`): an unauthenticated party can no longer make
  it buffer gigabytes. The default is sized from what florist sends (`message_limit`).
- Its registrations are bounded (`registrations.guard`): at most `--max-nodes` nodes, a rate per
  peer address, keys no larger than a real one, registrations that never connect expiring, and
  Fleet log lines that quote a remote value cut to one short line.

Where the installed Flower reads otherwise than 1.39.0, it runs the stock SuperLink and says, in
one line, what is then open.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import sys
from pathlib import Path

from florist.common.flower_internals import registrations
from florist.common.flower_internals import superlink as owner_guard
from florist.deploy.spawning import colours_for_terminals_only

log = logging.getLogger("flwr").getChild(__name__)

MIB = 2**20
FLOOR = 4 * MIB  # room for what every run sends besides its model: layouts, configs, metrics


def chunk_bytes() -> int:
    """The largest piece Flower sends an array in (it splits larger ones into several objects)."""
    from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE

    return int(FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE)


def message_limit(model_bytes: int | None = None) -> int:
    """The receive limit for a federation whose largest array is `model_bytes` (florist packs a
    model into one array): 4x the largest message that array makes, one Flower chunk at most;
    with no model known, 4x a whole chunk, which any model's messages fit."""
    largest = chunk_bytes() if model_bytes is None else min(int(model_bytes), chunk_bytes())
    return max(FLOOR, 4 * largest)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host(flower_args: list[str], flag: str = "--host", default: str = "127.0.0.1") -> str:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(flag, default=default)  # flower-superlink's defaults
    return getattr(parser.parse_known_args(flower_args)[0], flag.lstrip("-").replace("-", "_"))


def open_fleet(flower_args: list[str]) -> str | None:
    """The Fleet address, when it faces more than the loopback without node authentication:
    whoever reaches it may register (within the caps) and receive every run's app and messages."""
    fleet = _host(flower_args, "--fleet-api-address", "0.0.0.0:9092")
    if "--enable-supernode-auth" in flower_args or _loopback(fleet.rpartition(":")[0]):
        return None
    return fleet


@dataclasses.dataclass(frozen=True)
class Registrations:
    """How many nodes the SuperLink registers, how fast from one address, and how long a
    registration that never connects is kept once the cap is reached."""

    max_nodes: int = 10_000
    per_minute: float = 60.0
    expire_seconds: float = 600.0


def run(flower_args: list[str], max_message_mb: float | None = None, nodes: Registrations = Registrations()) -> None:
    """Run the SuperLink with `flower_args` in this process until it exits."""
    colours_for_terminals_only()
    limit = message_limit() if max_message_mb is None else int(max_message_mb * MIB)
    if limit < 1:
        raise ValueError(f"--max-message-mb must be positive, got {max_message_mb}")
    host, found = _host(flower_args), owner_guard.problems()
    if found:
        log.warning(
            "Flower's SuperLink reads otherwise than florist's guard expects (%s): running it stock, its "
            "Control API open to every user who reaches %s and its gRPC messages limited to 2 GiB",
            "; ".join(found),
            host,
        )
    else:
        owner_guard.limit_messages(limit)
        registrations.guard(nodes.max_nodes, nodes.per_minute, nodes.expire_seconds)
        logging.getLogger("flwr").addFilter(registrations.OneLineRemote())
        if not _loopback(host):
            log.warning("the Control API listens on %s: whoever reaches it there can submit runs", host)
        elif owner_guard.can_see_owners():
            owner_guard.serve_owner_only()
            log.info("Control and Runtime APIs on %s answer this user (uid of this process) only", host)
        else:
            log.warning("this machine does not report who owns a socket: every local user can submit runs")
        log.info("gRPC messages over %.1f MiB are refused", limit / MIB)
        if fleet := open_fleet(flower_args):
            log.warning(
                "the Fleet API on %s registers any node (without --enable-supernode-auth): whoever reaches it "
                "receives every run's app and messages",
                fleet,
            )
        log.info(
            "at most %d nodes register, %g a minute from one address; registrations that never connect expire "
            "after %g s once the cap is reached",
            nodes.max_nodes,
            nodes.per_minute,
            nodes.expire_seconds,
        )
    from flwr.superlink.cli.flower_superlink import flower_superlink

    # Flower starts `flower-superexec` by name: this environment's, whether or not it is activated.
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    sys.argv = ["flower-superlink", *flower_args]
    flower_superlink()
