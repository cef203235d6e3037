"""`florist export-partition`: one partition of a simulated scenario written as the data folder a
box joins with (`florist join --data-dir`), so a first deployment can use data whose results
the simulation already showed."""

from __future__ import annotations

import argparse
from pathlib import Path

from florist.cli.options import count, given, scenario_options


def add(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser(
        "export-partition",
        help="write one client's partition as a data folder for `florist join`",
        description="Write partition --partition-id of --num-partitions (the scenario flags as for `florist "
        "simulate`) to --out as train.npz (train + validation: a node carves its validation split itself) and "
        "test.npz, arrays x and y, as `florist join --data-dir` reads them.",
    )
    export.add_argument("--out", required=True, help="the data folder to write (created)")
    export.add_argument("--partition-id", type=int, required=True, metavar="I", help="which client, 0-based")
    export.add_argument("--num-partitions", type=count, required=True, metavar="N", help="clients in the scenario")
    export.add_argument("--seed", type=int, help="the scenario's seed (default: 1)")
    export.add_argument(
        "--unlabeled", action="store_true", help="write x only: a node that is served its model (OD-PFL's late joiner)"
    )
    scenario_options(export)
    export.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from florist.runners.partition import export_partition

    out = Path(args.out).expanduser()
    data = export_partition(given(args), args.partition_id, args.num_partitions, out, args.unlabeled)
    print(
        f"{out}: {'unlabeled ' * args.unlabeled}train.npz ({len(data.x_train) + len(data.x_val)} samples), "
        f"test.npz ({len(data.x_test)}), x {data.x_train.dtype} of shape {data.x_train.shape[1:]}; "
        f"join with: florist join --data-dir {out} ..."
    )
    return 0
