"""`florist simulate`: one strategy on simulated clients, in this process or Flower's simulation
runtime (`--runtime`), with a progress bar and the seen/unseen summary."""

from __future__ import annotations

import argparse
from typing import Any

from florist.cli.display import Bars, print_summary
from florist.cli.options import DEFAULT_NODES, count, launch, resource_options, run_options, runtime_option
from florist.server.report import number


def add(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser(
        "simulate",
        help="run a strategy on simulated clients, in this process or in Flower's simulation runtime (Ray)",
        description="Run one strategy on --num-clients simulated clients of --dataset (the embedded digits by "
        "default), called one after the other in this process or side by side in Flower's simulation runtime "
        "(--runtime), and print the seen/unseen summary. Writes results.json, report.md and plots to --results-dir.",
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
    asked = launch(args)  # a run config that cannot work is refused here, before torch is imported

    from florist.runners.simulation import (
        run as simulate,  # it imports torch and flwr: `florist --help` does not wait for them
    )

    with RoundBars() as bars:
        results = simulate(asked, bars)
    print_summary(results, bars.console, bars.wall())
    return 0


class RoundBars(Bars):
    """The run's rounds as they finish, with the last round's loss and seen accuracy."""

    def __init__(self) -> None:
        super().__init__("{task.fields[status]}")
        self.rounds, self.bar = 0, None

    def started(self, runs: int, rounds: int) -> None:
        super().started(runs, rounds)
        self.rounds = rounds

    def run(self, strategy: str, seed: int, reused: bool) -> None:
        self.bar = self.progress.add_task(f"{strategy} rounds", total=self.rounds, status="starting clients")

    def round(self, row: dict[str, Any]) -> None:
        self.progress.update(
            self.bar,
            completed=row["round"],
            status=f"loss {number(row['train_loss'], '.3f')}  seen acc {number(row['accuracy'], '.1%')}"
            + (f"  ε {row['dp_epsilon']:.3g}" if row.get("dp_epsilon") is not None else "")  # spent so far, under `dp`
            + (f"  ε/node ≤ {eps:.3g}" if (eps := row.get("dp_record_epsilon")) is not None else ""),
        )
