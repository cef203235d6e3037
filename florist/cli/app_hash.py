"""`florist app-hash`: the sha256 of the app bundle `flwr run DIR` submits, for an operator to
give the boxes that should run it (`florist join --trust-app`, `florist supernode --trust-app`)."""

from __future__ import annotations

import argparse


def add(sub: argparse._SubParsersAction) -> None:
    app_hash = sub.add_parser(
        "app-hash",
        help="print the sha256 of the app bundle `flwr run DIR` would submit (what boxes --trust-app)",
        description="Build the app bundle that `flwr run DIR` would submit, exactly as it would, and print its "
        "sha256: the value a box gives `florist join --trust-app` (or `florist supernode --trust-app`) to run "
        "that app and refuse every other. Any edit to a bundled file changes it.",
    )
    app_hash.add_argument("dir", nargs="?", metavar="DIR", help="the app's folder (default: florist's checkout)")
    app_hash.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from florist.deploy.bundle import bundle_hash

    print(bundle_hash(Path(args.dir) if args.dir else None))
    return 0
