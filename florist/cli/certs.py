"""`florist certs`: the certificates and keys of a TLS, authenticated federation."""

from __future__ import annotations

import argparse
from pathlib import Path

from florist.cli.options import count


def add(sub: argparse._SubParsersAction) -> None:
    certs = sub.add_parser(
        "certs",
        help="make a CA, a SuperLink certificate and SuperNode key pairs",
        description="Write ca.crt/ca.key, server.pem/server.key (SANs from --hosts, plus 127.0.0.1) and "
        "keys/node-<i>, keys/node-<i>.pub (ECDSA P-384, OpenSSH format) to --out.",
    )
    certs.add_argument("--out", required=True, help="output folder")
    certs.add_argument(
        "--hosts", required=True, help='names/IPs SuperNodes dial, comma-separated, e.g. "superlink,10.0.0.5"'
    )
    certs.add_argument("--num-nodes", type=count, default=3, help="SuperNode key pairs to make (default: 3)")
    certs.add_argument("--force", action="store_true", help="replace a CA already in --out")
    certs.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from florist.deploy.certs import make_certificates

    paths = make_certificates(args.out, args.hosts.split(","), args.num_nodes, args.force)
    print(f"CA: {paths['ca']}\nSuperLink certificate: {paths['server_cert']} (key {paths['server_key']})")
    print(f"SuperNode keys: {Path(args.out) / 'keys'}/node-<i> and node-<i>.pub, i = 0..{args.num_nodes - 1}")
    return 0
