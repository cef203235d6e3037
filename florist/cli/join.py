"""`florist join`: a SuperNode on this box, joining a running federation, with its data and
connection checked first."""

from __future__ import annotations

import argparse

from florist.cli.options import executor_option
from florist.cli.signals import interrupt_on_signals
from florist.cli.supernode import trust_app_option


def add(sub: argparse._SubParsersAction) -> None:
    join = sub.add_parser(
        "join",
        help="start a SuperNode on this box and join a running federation",
        description="Check the data folder, then start a SuperNode for this box pointed at the SuperLink's Fleet "
        "API, with node config data-dir, node-key and state-dir. Explains failures: unreachable SuperLink, "
        "certificate mismatch (wrong CA, or issued for other host names), key not registered, ill-formed data. "
        "Without --root-certificates it dials only when told --insecure.",
    )
    join.add_argument("--superlink", required=True, metavar="HOST:PORT", help="the SuperLink's Fleet API address")
    join.add_argument("--data-dir", required=True, help="train.npz + test.npz, or ImageFolder trees train/ and test/")
    join.add_argument("--root-certificates", metavar="CA", help="CA certificate of the SuperLink (enables TLS)")
    join.add_argument(
        "--insecure",
        action="store_true",
        help="dial without TLS: traffic unencrypted and the SuperLink unauthenticated (required without "
        "--root-certificates)",
    )
    join.add_argument(
        "--auth-key", metavar="KEY", help="this node's private key (its .pub registered on the SuperLink)"
    )
    join.add_argument("--state-dir", help="node state folder (default: ~/.cache/florist/nodes)")
    join.add_argument("--node-key", help="stable name of this node (default: the host name)")
    join.add_argument("--num-classes", type=int, default=10, help="label range to check the data against (default: 10)")
    join.add_argument(
        "--device",
        help="where this node trains, overriding the run's device: auto | cpu | cuda | "
        "cuda:N | mps (default: the run's, auto)",
    )
    join.add_argument(
        "--max-wait-time", type=float, default=60.0, help="give up connecting after this many seconds (default: 60)"
    )
    executor_option(join)
    trust_app_option(join)
    join.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from florist.deploy.join import join

    interrupt_on_signals()
    return join(
        args.superlink,
        args.data_dir,
        root_certificates=args.root_certificates,
        insecure=args.insecure,
        auth_key=args.auth_key,
        state_dir=args.state_dir,
        node_key=args.node_key,
        num_classes=args.num_classes,
        max_wait_time=args.max_wait_time,
        executor=args.executor,
        device=args.device,
        trust_apps=args.trust_app,
    )
