"""`florist superlink`: Flower's SuperLink, run in this process, guarded where Flower 1.39 is open.

- Its HTTP APIs (Control: run submission, node registration; Runtime: a run's tasks), when they
  listen on the loopback, answer only this user's connections (`serve_owner_only`): no other
  user of the machine can submit a run, which would execute on the SuperLink and every SuperNode.
  Listening elsewhere (docker compose: an address on a network of its own) they are as open as
  that network, and it says so in one line.
- Its gRPC servers (the Fleet API) refuse a message over `--max-message-mb` from its length
  prefix, before reading the body (`limit_messages`): an unauthenticated party can no longer make
  it buffer gigabytes. The default is sized from what florist sends (`message_limit`).

Where the installed Flower reads otherwise than 1.39.0, it runs the stock SuperLink and says, in
one line, what is then open.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path

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


def _host(flower_args: list[str]) -> str:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--host", default="127.0.0.1")  # flower-superlink's default
    return parser.parse_known_args(flower_args)[0].host


def run(flower_args: list[str], max_message_mb: float | None = None) -> None:
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
        owner_guard.limit_public_keys()
        if not _loopback(host):
            log.warning("the Control API listens on %s: whoever reaches it there can submit runs", host)
        elif owner_guard.can_see_owners():
            owner_guard.serve_owner_only()
            log.info("Control and Runtime APIs on %s answer this user (uid of this process) only", host)
        else:
            log.warning("this machine does not report who owns a socket: every local user can submit runs")
        log.info("gRPC messages over %.1f MiB are refused", limit / MIB)
    from flwr.superlink.cli.flower_superlink import flower_superlink

    # Flower starts `flower-superexec` by name: this environment's, whether or not it is activated.
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    sys.argv = ["flower-superlink", *flower_args]
    flower_superlink()
