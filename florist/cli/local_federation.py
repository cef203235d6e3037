"""`florist local-federation`: a SuperLink and SuperNodes on this machine that keep running,
for `flwr run` to submit runs to, until Ctrl-C."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from florist.cli.options import DEFAULT_NODES, federation_options, node_configs
from florist.cli.signals import interrupt_on_signals
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
    from florist.deploy.bundle import TrustedApps, bundle_hash
    from florist.deploy.federation import LocalFederation

    parse_partition(args.partition)  # it goes into the printed run line: refuse a wrong one now
    workdir = Path(args.state_dir).expanduser().resolve()
    # The checkout's bundle as it is now (what the printed `flwr run .` submits), and any other named.
    trusted = sorted(TrustedApps.parse([bundle_hash(), *args.trust_app]).hashes)
    interrupt_on_signals()
    num_nodes = args.num_nodes or DEFAULT_NODES[args.command]
    with LocalFederation(
        workdir,
        node_configs(num_nodes, workdir),
        tls=args.tls,
        auth=args.auth,
        executor=args.executor,
        persistent=args.persistent,
        trust_apps=trusted,
        max_message_bytes=args.max_message_mb and int(args.max_message_mb * 2**20),
    ) as fed:
        print(fed.describe().replace("...", f'partition="{args.partition}"'), flush=True)
        print("Running; Ctrl-C stops the SuperLink and SuperNodes started here.", flush=True)
        try:
            while fed.superlink.alive():
                fed.ensure_runs_served()
                time.sleep(1)
            print(f"the SuperLink exited:\n{fed.superlink.tail()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("stopping...", flush=True)
    return 0
