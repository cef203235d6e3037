"""PerFed-CKT's own command, `florist public-hash`: the fingerprint of a node's public set P,
for the run config's `public-hash`. Only argparse at import."""

from __future__ import annotations

import argparse


def add(sub: argparse._SubParsersAction) -> None:
    """`public-hash`, on the `florist` command's subparsers."""
    public = sub.add_parser(
        "public-hash",
        help="print the fingerprint of a PerFed-CKT public set P, for the run config",
        description="Every PerFed-CKT node must hold the same public unlabeled set P. Run this on a node's copy "
        "(public.npz with array x, or a folder of images) and put the printed line in the run config; a node "
        "whose P differs then refuses to train instead of learning from the wrong data.",
    )
    public.add_argument("public_dir", metavar="DIR", help="the folder with public.npz or the images")
    public.add_argument("--num-classes", type=int, default=10, help="label range, if public.npz has y (default: 10)")
    public.set_defaults(func=public_hash)


def public_hash(args: argparse.Namespace) -> int:
    from florist.common import data, folders

    print(f'public-hash = "{data.fingerprint(folders.folder_public(args.public_dir, args.num_classes))}"')
    return 0
