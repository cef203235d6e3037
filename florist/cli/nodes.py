"""`florist nodes`: who is in the federation, by the florist names of the boxes' keys (what
`flwr supernode list` cannot say), and `florist nodes register`: every key of a certificates
folder registered with the SuperLink in one go, as often as needed."""

from __future__ import annotations

import argparse

from florist.cli.options import path

HEADER = ["NAME", "NODE ID", "FINGERPRINT", "STATUS", "LAST SEEN"]


def add(sub: argparse._SubParsersAction) -> None:
    nodes = sub.add_parser(
        "nodes",
        help="list the SuperLink's nodes by their key names, or register every key of a folder",
        description="`florist nodes` lists every SuperNode the SuperLink has registered, one line each: the name of "
        "its key (the *.pub in --certs with the same SHA256 fingerprint, as `ssh-keygen -lf` prints it; else the "
        "name it was registered under), its node id, the fingerprint, online/offline/registered (never connected) "
        "and when it was last seen; keys in --certs that are not registered follow. `florist nodes register` runs "
        "`flwr supernode register KEY.pub CONNECTION --name NAME` for every *.pub in --certs (and its keys/): a key "
        "already registered keeps its node id and is said so. Run both on the SuperLink's machine.",
    )
    nodes.add_argument("action", nargs="?", choices=("list", "register"), default="list", help="default: list")
    nodes.add_argument(
        "--certs",
        action="append",
        type=path,
        metavar="DIR",
        help="a folder of public keys (*.pub there and in DIR/keys, e.g. `florist certs`' --out); repeatable",
    )
    nodes.add_argument(
        "--connection",
        metavar="NAME",
        help="the `flwr` connection of the SuperLink in $FLWR_HOME/config.toml (default: its default)",
    )
    nodes.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from florist.deploy.nodes import connection, node_table, public_keys, register_keys, registered_nodes

    folders = [Path(folder) for folder in args.certs or []]
    conn = connection(args.connection)
    if args.action == "register":
        if not folders:
            raise ValueError("florist nodes register: pass --certs DIR, the folder of the keys to register")
        for line in register_keys(folders, conn):
            print(line, flush=True)
        return 0
    print_table([HEADER, *node_table(registered_nodes(conn), public_keys(folders))])
    return 0


def print_table(rows: list[list[str]]) -> None:
    """Columns as wide as their widest cell: one line per node, whatever the terminal."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
