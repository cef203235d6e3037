"""`florist certs`: the certificates and keys of a TLS, authenticated federation, on the
SuperLink's machine, and a box's own key pair (`--node-key-only`) on the box."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_NODES = 3


def node_count(text: str) -> int:
    """A number of SuperNode key pairs: 0 (the boxes make their own) or more."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return int(text)


def add(sub: argparse._SubParsersAction) -> None:
    certs = sub.add_parser(
        "certs",
        help="make the SuperLink's CA and certificate, or (on a box) the box's own key pair",
        description="On the SuperLink's machine: write ca.crt and server.pem/server.key (SANs from --hosts, plus "
        "127.0.0.1) to --out, and keys/node-<i>, keys/node-<i>.pub (ECDSA P-384, OpenSSH format) for the "
        "SuperNodes run from that machine (docker compose, one-machine tests). The CA's key is not kept: it signs "
        "the SuperLink's certificate only, and SuperNodes are known by their registered public keys. On a box: "
        "--node-key-only NAME writes only that box's key pair, DIR/NAME and DIR/NAME.pub, and prints the command "
        "that registers the .pub with the SuperLink; the private key never leaves the box. Folders are made 0700; "
        "one that another user owns or can write is refused.",
    )
    certs.add_argument("--out", required=True, metavar="DIR", help="output folder (made 0700)")
    what = certs.add_mutually_exclusive_group(required=True)
    what.add_argument("--hosts", help='names/IPs SuperNodes dial, comma-separated, e.g. "superlink,10.0.0.5"')
    what.add_argument(
        "--node-key-only",
        metavar="NAME",
        help="on a box: make only its key pair DIR/NAME and DIR/NAME.pub (an existing key is never replaced)",
    )
    certs.add_argument(
        "--num-nodes",
        type=node_count,
        help=f"SuperNode key pairs to make in DIR/keys, 0 when every box makes its own (default: {DEFAULT_NODES}; "
        "existing ones are kept)",
    )
    certs.add_argument("--force", action="store_true", help="replace a CA already in --out (copy the new one to boxes)")
    certs.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from florist.deploy.certs import make_certificates, make_node_key, old_ca_key

    out = Path(args.out)
    if args.node_key_only is not None:
        if args.force or args.num_nodes is not None:
            raise ValueError("--node-key-only makes one key pair and never replaces one: drop --num-nodes and --force")
        private, public = make_node_key(out, args.node_key_only)
        print(f"Key pair: {private} (stays here: florist join --auth-key {private}) and {public}")
        register = f"flwr supernode register {public.name} <connection>"
        print(f"Send {public.name} to the SuperLink's operator, who registers it with: {register}")
        return 0
    num_nodes = DEFAULT_NODES if args.num_nodes is None else args.num_nodes
    paths = make_certificates(out, args.hosts.split(","), num_nodes, args.force)
    print(f"CA certificate: {paths['ca']} (copy it to every box; the CA's key was not kept)")
    print(f"SuperLink certificate: {paths['server_cert']} (key {paths['server_key']})")
    if num_nodes:
        print(f"SuperNode keys: {out / 'keys'}/node-<i> and node-<i>.pub, i = 0..{num_nodes - 1}")
    print(
        "Any other box makes its own key pair (florist certs --node-key-only NAME --out DIR) and sends NAME.pub "
        "here to register: flwr supernode register NAME.pub <connection>"
    )
    if note := old_ca_key(out):
        print(f"Note: {note}")
    return 0
