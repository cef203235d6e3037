"""`florist simulate`: one strategy in Flower's simulation runtime, with a progress bar and the
seen/unseen summary."""

from __future__ import annotations

import argparse
import time
from typing import Any

from florist.cli.options import (
    DEFAULT_NODES,
    checked_config,
    chosen_runtime,
    count,
    decode_data,
    print_summary,
    resource_options,
    run_options,
    run_simulated,
    runtime_option,
    stderr_console,
)
from florist.cli.signals import interrupt_on_signals


def add(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser(
        "simulate",
        help="run a strategy in Flower's simulation runtime on the embedded digits",
        description="Run one strategy in Flower simulation (one process, Ray workers) and print the "
        "seen/unseen summary. Writes results.json, report.md and plots to --results-dir.",
    )
    run_options(sim)
    sim.add_argument(
        "--num-clients",
        type=count,
        dest="num_nodes",
        help=f"simulated SuperNodes = partitions (default: {DEFAULT_NODES['simulate']})",
    )
    resource_options(sim)
    runtime_option(sim)
    sim.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from florist.runners import raycluster
    from florist.runners.simulation import client_resources
    from florist.server.report import number

    args.runtime = chosen_runtime(args)
    args.ray_address = raycluster.address_of(args.ray_address, args.runtime)
    (cfg, num_clients), console, start = checked_config(args), stderr_console(), time.monotonic()
    resources = client_resources(args.cpus_per_client, args.gpus_per_client, cluster=bool(args.ray_address))
    interrupt_on_signals()
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        decode_data(progress, cfg, num_clients)
        task = progress.add_task(f"{cfg.strategy} rounds", total=cfg.num_server_rounds, status="starting clients")

        def on_round(row: dict[str, Any]) -> None:
            progress.update(
                task,
                completed=row["round"],
                status=f"loss {number(row['train_loss'], '.3f')}  seen acc {number(row['accuracy'], '.1%')}",
            )

        results = run_simulated(args.runtime, cfg, num_clients, on_round, resources, args.ray_address)
    print_summary(results, console, time.monotonic() - start)
    return 0
