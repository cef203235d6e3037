"""`florist local-federation`: a SuperLink and SuperNodes on this machine that keep running,
for `flwr run` to submit runs to, until Ctrl-C."""

from __future__ import annotations

import argparse
import sys

from florist.cli.display import Display
from florist.cli.options import DEFAULT_NODES, federation, federation_options, path
from florist.cli.supernode import trust_app_option


def add(sub: argparse._SubParsersAction) -> None:
    fed = sub.add_parser(
        "local-federation",
        help="start a SuperLink + SuperNodes on 127.0.0.1 and keep them running",
        description="Start a SuperLink and --num-nodes SuperNodes (embedded digits partitions) on 127.0.0.1 with "
        "free ports, wait until all are connected, print the addresses and the `flwr run` line, and run until "
        "Ctrl-C, which stops exactly the processes started here.",
    )
    federation_options(fed)
    fed.add_argument("--partition", default="dirichlet:0.3", help="partition to put in the printed run line")
    fed.add_argument(
        "--state-dir",
        type=path,
        default="florist-federation",
        help="federation folder: certificates, keys, logs, node state, and with --persistent the "
        "SuperLink's database (default: ./florist-federation)",
    )
    fed.add_argument(
        "--persistent",
        action="store_true",
        help="keep the SuperLink's state in STATE_DIR/superlink.db, so that a restarted SuperLink keeps "
        "node identities and registered keys (SQLite makes every exchange 2-3 times slower)",
    )
    trust_app_option(
        fed,
        "an app bundle the SuperNodes run besides this checkout's as it is at start (its sha256, printed by "
        "`florist app-hash DIR`; repeatable); any other is refused. After editing the checkout, restart",
    )
    fed.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from florist.common.data import parse_partition
    from florist.runners.federation import serve

    parse_partition(args.partition)  # it goes into the printed run line: refuse a wrong one now
    tail = serve(federation(args), args.num_nodes or DEFAULT_NODES[args.command], ServingDisplay(args.partition))
    if tail is None:  # stopped by Ctrl-C
        return 0
    print(f"the SuperLink exited:\n{tail}", file=sys.stderr)
    return 1


class ServingDisplay(Display):
    """Where the federation is and the `flwr run` line that submits to it, with `partition`."""

    def __init__(self, partition: str) -> None:
        super().__init__()
        self.partition = partition

    def federation(self, description: str) -> None:
        print(description.replace("...", f'partition="{self.partition}"'), flush=True)
        print("Running; Ctrl-C stops the SuperLink and SuperNodes started here.", flush=True)

    def stopping(self) -> None:
        print("stopping...", flush=True)
