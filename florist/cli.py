"""The `florist` command."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from florist.common.config import RunConfig, parse_overrides


def _simulate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from florist.server.simulation import simulate

    overrides = parse_overrides(args.run_config or "")
    flags = {"strategy": args.strategy, "partition": args.partition, "num-server-rounds": args.rounds,
             "seed": args.seed, "unseen-fraction": args.unseen_fraction, "results-dir": args.results_dir}  # fmt: skip
    values = {k: v for k, v in flags.items() if v is not None} | overrides
    values.setdefault("min-nodes", args.num_clients)
    cfg = RunConfig.from_mapping(values)
    console = Console(stderr=True)
    start = time.monotonic()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=console) as progress:  # fmt: skip
        task = progress.add_task(f"{cfg.strategy} rounds", total=cfg.num_server_rounds, status="starting clients")

        def on_round(row: dict[str, Any]) -> None:
            loss = "–" if row["train_loss"] is None else f"{row['train_loss']:.3f}"
            acc = "–" if row["accuracy"] is None else f"{100 * row['accuracy']:.1f}%"
            progress.update(task, completed=row["round"], status=f"loss {loss}  seen acc {acc}")

        results = simulate(cfg, args.num_clients, on_round)
    print_summary(results, console, time.monotonic() - start)
    return 0


def print_summary(results: dict[str, Any], console, wall: float) -> None:
    from rich.table import Table

    from florist.server.report import summary_rows

    table = Table(title=f"florist · {results['strategy']} · {results['config']['partition']}")
    for column in ("strategy", "clients", "n", "mean acc. (%)", "bottom decile (%)"):
        table.add_column(column, justify="right" if column[0] in "nmb" else "left")
    for row in summary_rows(results):
        table.add_row(*row)
    console.print(table)
    console.print(f"wall time {wall:.1f} s · results in {results['config']['results-dir']}/ (results.json, report.md, plots)")


def build_parser() -> argparse.ArgumentParser:
    from florist.strategies import STRATEGIES

    parser = argparse.ArgumentParser(
        prog="florist", description="Personalized federated learning on Flower: simulate, deploy, compare."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sim = sub.add_parser(
        "simulate",
        help="run a strategy in Flower's simulation runtime on the embedded digits",
        description="Run one strategy in Flower simulation (one process, Ray workers) and print the "
        "seen/unseen summary. Writes results.json, report.md and plots to --results-dir.",
    )
    sim.add_argument("--strategy", choices=sorted(STRATEGIES), help="algorithm to run (default: fedavg)")
    sim.add_argument("--num-clients", type=int, default=20, help="simulated SuperNodes = partitions (default: 20)")
    sim.add_argument("--partition", help="iid | dirichlet:ALPHA | pathological:K (default: dirichlet:0.3)")
    sim.add_argument("--rounds", type=int, help="server rounds (default: 30)")
    sim.add_argument("--seed", type=int, help="seed for partitions, splits, init and sampling (default: 1)")
    sim.add_argument("--unseen-fraction", type=float, help="fraction of clients held out of training (default: 0.2)")
    sim.add_argument("--results-dir", help="output folder (default: results)")
    sim.add_argument(
        "--run-config",
        metavar='"k=v ..."',
        help='any other run-config keys, as for `flwr run --run-config`, e.g. "lr=0.1 local-epochs=2"',
    )
    sim.set_defaults(func=_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TimeoutError) as err:
        print(f"florist: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
