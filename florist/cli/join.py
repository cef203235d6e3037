"""`florist join`: a SuperNode on this box, joining a running federation, with its data and
connection checked first."""

from __future__ import annotations

import argparse

from florist.cli.options import executor_option, path, positive_float
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
    join.add_argument(
        "--data-dir", type=path, required=True, help="train.npz + test.npz, or ImageFolder trees train/ and test/"
    )
    join.add_argument(
        "--root-certificates", type=path, metavar="CA", help="CA certificate of the SuperLink (enables TLS)"
    )
    join.add_argument(
        "--insecure",
        action="store_true",
        help="dial without TLS: traffic unencrypted and the SuperLink unauthenticated (required without "
        "--root-certificates)",
    )
    join.add_argument(
        "--auth-key", type=path, metavar="KEY", help="this node's private key (its .pub registered on the SuperLink)"
    )
    join.add_argument("--state-dir", type=path, help="node state folder (default: ~/.cache/florist/nodes)")
    join.add_argument("--node-key", help="stable name of this node (default: the host name)")
    join.add_argument("--num-classes", type=int, default=10, help="label range to check the data against (default: 10)")
    join.add_argument(
        "--device",
        help="where this node trains, overriding the run's device: auto | cpu | cuda | "
        "cuda:N | mps (default: the run's, auto)",
    )
    join.add_argument(
        "--max-wait-time",
        type=wait_time,
        default=60.0,
        metavar="SECONDS|forever",
        help="give up connecting after this many seconds without the SuperLink, or never: `forever` keeps retrying, "
        "for a box that must rejoin whenever the SuperLink is back (default: 60)",
    )
    join.add_argument(
        "--unseen",
        action="store_true",
        help="this box never trains: the run scores it on the model it gives a new client (as unseen-fraction does)",
    )
    join.add_argument(
        "--node-config",
        default="",
        metavar='"k=v ..."',
        help="more of this node's config: its caps (node-max-classes, node-max-steps, node-max-seconds, "
        "node-max-batch-size, node-max-threads), torch-threads, public-dir, and run settings a node may override",
    )
    executor_option(join)
    trust_app_option(join)
    join.set_defaults(func=run)


def wait_time(text: str) -> float | None:
    """Seconds to keep trying the SuperLink, > 0, or `forever` (None)."""
    if text.strip().lower() == "forever":
        return None
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0 or forever, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from florist.config import parse_overrides
    from florist.deploy.join import join

    node_config = parse_overrides(args.node_config)  # Flower's `k=v` syntax, as --run-config
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
        unseen=args.unseen,
        node_config=node_config,
    )
