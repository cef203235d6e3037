"""What the commands show while a run goes and once it ends: the preflight's warnings, progress
bars on stderr, the seen/unseen summary. A run reports through `Events` (`runners/launch.py`);
each command's display shows what it cares for. rich is imported when a display first shows."""

from __future__ import annotations

import sys
import time
from typing import Any

from florist.cli.signals import interrupt_on_signals
from florist.runners.launch import Events
from florist.server.report import FIGURES, SUMMARY_COLUMNS, privacy_lines, summary_rows, summary_title


class Display(Events):
    """The preflight's warnings, one line each on stderr. From `started` on, `wall` counts the
    seconds; Ctrl-C and SIGTERM stop the run (`cli/signals.py`, set again here for callers other
    than `florist`'s main, which sets them before any command)."""

    def __init__(self) -> None:
        self.began = time.monotonic()

    def warning(self, text: str) -> None:
        print(f"florist: warning: {text}", file=sys.stderr)

    def started(self, runs: int, rounds: int) -> None:
        self.began = time.monotonic()
        interrupt_on_signals()

    def wall(self) -> float:
        return time.monotonic() - self.began


class Bars(Display):
    """Progress bars on stderr, from `started` to the end of the `with` block the display is
    used in: one for the decoding of a dataset's partitions, and the `columns` a command adds."""

    def __init__(self, *columns: str) -> None:
        super().__init__()
        self.console, self.columns, self.progress, self.decoding_bar = stderr_console(), columns, None, None

    def __enter__(self) -> Bars:
        return self

    def __exit__(self, *_: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def started(self, runs: int, rounds: int) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        super().started(runs, rounds)
        columns = [TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}")]
        columns += [TextColumn(c) for c in self.columns]
        # not a terminal (a log file): no bars, whose last frame rich would print there at the end
        self.progress = Progress(
            *columns, TimeElapsedColumn(), console=self.console, disable=not self.console.is_terminal
        )
        self.progress.start()

    def decoded(self, partitions: int, of: int) -> None:
        if partitions == 0 and self.decoding_bar is None:
            self.decoding_bar = self.progress.add_task("decoding data", total=of, status="")
        elif partitions == 0:  # the next dataset of a comparison: the same bar again
            self.progress.reset(self.decoding_bar, total=of, description="decoding data")
        self.progress.update(self.decoding_bar, completed=partitions)
        if partitions == of:
            self.progress.update(self.decoding_bar, description="data decoded")

    def decoding(self, partition: int, done: int, total: int) -> None:
        self.progress.update(self.decoding_bar, description=f"decoding partition {partition}: {done}/{total}")


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def print_summary(results: dict[str, Any], console, wall: float, table: bool = True) -> None:
    """The seen/unseen table (the rows report.md shows; `table=False` where the run's streamed
    log has just shown it), the nodes left out of rounds, and where the results are."""
    from rich.markup import escape
    from rich.table import Table

    if table:
        shown = Table(title=summary_title(results))
        for i, column in enumerate(SUMMARY_COLUMNS):
            shown.add_column(column, justify="right" if i >= FIGURES else "left")
        for row in summary_rows(results):
            shown.add_row(*row)
        console.print(shown)
    failed: dict[tuple[str, str], list[int]] = {}
    for failure in results.get("failures", []):
        failed.setdefault((failure["node"], failure["reason"]), []).append(failure["round"])
    for (node, reason), rounds in failed.items():
        console.print(
            f"[yellow]{escape(node)} left out of round(s) {', '.join(map(str, sorted(set(rounds))))}:[/] "
            f"{escape(reason)}",
            highlight=False,
        )
    for line in privacy_lines(results):  # under `dp`: the ε spent, and a budget's stop
        if line:
            console.print(escape(line.replace("`", "")), highlight=False)
    console.print(
        f"wall time {wall:.1f} s · results in {results['config']['results-dir']}/ (results.json, report.md, plots)"
    )
