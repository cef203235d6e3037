"""`florist certs`: the certificates and keys of a TLS, authenticated federation, on the
SuperLink's machine; one more box's key pair there (`--add-node`), or a box's own key pair on the
box (`--node-key-only`)."""

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
        "that registers the .pub with the SuperLink; the private key never leaves the box. On the SuperLink's "
        "machine, --add-node NAME adds one more box to a folder made before: DIR/keys/NAME and NAME.pub beside the "
        "others, from the existing CA (never made again), and prints what to copy to the box (its private key and "
        "ca.crt) and how to register it; prefer --node-key-only on the box where its key should never travel. "
        "Folders are made 0700; one that another user owns or can write is refused.",
    )
    certs.add_argument("--out", required=True, metavar="DIR", help="output folder (made 0700)")
    what = certs.add_mutually_exclusive_group(required=True)
    what.add_argument("--hosts", help='names/IPs SuperNodes dial, comma-separated, e.g. "superlink,10.0.0.5"')
    what.add_argument(
        "--node-key-only",
        metavar="NAME",
        help="on a box: make only its key pair DIR/NAME and DIR/NAME.pub (an existing key is never replaced)",
    )
    what.add_argument(
        "--add-node",
        metavar="NAME",
        help="on the SuperLink's machine: add a box's key pair DIR/keys/NAME[.pub] to an existing folder (its CA is "
        "kept; the private key must then be copied to the box); --node-key-only makes it on the box instead",
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
    one_key = next(
        (f for f, v in (("--node-key-only", args.node_key_only), ("--add-node", args.add_node)) if v is not None), None
    )
    if one_key and (args.force or args.num_nodes is not None):
        raise ValueError(f"{one_key} makes one key pair and never replaces one: drop --num-nodes and --force")
    if args.add_node is not None:
        return add_node(out, args.add_node)
    if args.node_key_only is not None:
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


def add_node(out: Path, name: str) -> int:
    """What a box added on the SuperLink's machine needs, and the commands that follow."""
    from florist.deploy.certs import add_node as add

    private, public = add(out, name)
    print(f"Key pair: {private} and {public}; the CA ({out / 'ca.crt'}) is unchanged")
    print(
        f"Copy to the box, over a channel you trust: {private} (its private key: delete it here once copied) "
        f"and {out / 'ca.crt'}"
    )
    print(f"Register it: florist nodes register --certs {out} (or: flwr supernode register {public} <connection>)")
    print(
        f"On the box: florist join --superlink HOST:9092 --root-certificates ca.crt --auth-key {name} "
        f"--node-key {name} --data-dir DIR"
    )
    return 0
