"""`florist superlink`: Flower's SuperLink with its HTTP APIs kept to this user and its gRPC
messages size-limited (every option of `flower-superlink` passes through)."""

from __future__ import annotations

import argparse

from florist.cli.options import count, positive_float


def add(sub: argparse._SubParsersAction) -> None:
    link = sub.add_parser(
        "superlink",
        help="run a Flower SuperLink whose Control API only this user reaches (flower-superlink's options, plus "
        "--max-message-mb)",
        description="Flower's SuperLink (every option of `flower-superlink --help` is accepted and passed on), "
        "guarded where Flower 1.39 is open: on the loopback (its default --host) the Control and Runtime APIs "
        "answer only connections from this user, so no other local user can submit a run; and its Fleet API "
        "refuses gRPC messages over --max-message-mb before reading them. Runs in the foreground.",
        allow_abbrev=False,
    )
    link.add_argument(
        "--max-message-mb",
        type=positive_float,
        metavar="MB",
        help="the largest gRPC message accepted, in MiB (default: 4 x the largest message Flower makes of an "
        "array, 20 MiB; `deploy-local` sizes it from the run's model)",
    )
    link.add_argument(
        "--max-nodes", type=count, default=10_000, metavar="N", help="nodes registered at most (default 10000)"
    )
    link.add_argument(
        "--registrations-per-minute",
        type=positive_float,
        default=60.0,
        metavar="R",
        help="registrations taken from one address a minute (default 60)",
    )
    link.add_argument(
        "--registration-expiry",
        type=positive_float,
        default=600.0,
        metavar="S",
        help="at the --max-nodes cap, registrations that never connected within S seconds are removed (default 600)",
    )
    link.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from florist.deploy import superlink

    nodes = superlink.Registrations(args.max_nodes, args.registrations_per_minute, args.registration_expiry)
    superlink.run(args.flower_args, args.max_message_mb, nodes)
    return 0
