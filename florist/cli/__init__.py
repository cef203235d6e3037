"""The `florist` command: `build_parser` assembles its commands, one module each here (the
options several share live in `options.py`, what they show in `display.py`), and every
strategy's own (its spec's `commands`); `main` runs the one asked for and turns what a user can
get wrong into one line and an exit status. A command parses its flags, calls one function of
`florist/runners/` (or `florist/deploy/`) that does the work, and prints what it returns. The
modules import only argparse and what a run config needs: torch, rich, flwr and ray are imported
by the command that runs, so `florist --help` and a usage error are quick."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
from collections.abc import Iterable

from florist import USER_ERRORS
from florist.apps.registry import STRATEGIES
from florist.cli import (
    app_hash,
    certs,
    compare,
    deploy_local,
    export,
    export_partition,
    join,
    local_federation,
    nodes,
    predict,
    simulate,
    superlink,
    supernode,
)
from florist.cli.signals import forget_interrupt, ignore_signals, interrupt_on_signals
from florist.common.spec import StrategySpec

# In the order `florist --help` lists them; each strategy's own commands come after these.
COMMANDS = (
    simulate,
    deploy_local,
    local_federation,
    certs,
    nodes,
    join,
    predict,
    export,
    export_partition,
    supernode,
    superlink,
    app_hash,
    compare,
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line and a hint, not the whole usage text."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the options)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"florist {version('florist')} (Flower {version('flwr')})"
    except PackageNotFoundError:
        return "florist (not installed as a package)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="florist", description="Personalized federated learning on Flower: simulate, deploy, join.")
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also FLORIST_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add(sub)
    add_strategy_commands(sub, STRATEGIES.values())
    parser.set_defaults(commands=sub.choices)  # a mistake after a command is that command's to explain
    return parser


def add_strategy_commands(sub: argparse._SubParsersAction, specs: Iterable[StrategySpec]) -> None:
    """The commands the strategies declare, in the registry's order. A `commands` function that
    several specs share adds its commands once; two that name the same command (or one of
    florist's) are a mistake, refused here with the strategy's name."""
    added = set()
    for spec in specs:
        if spec.commands is None or spec.commands in added:
            continue
        try:
            spec.commands(sub)
        except argparse.ArgumentError as err:
            raise RuntimeError(f"the commands of strategy {spec.name!r}: {err}") from None
        added.add(spec.commands)


def main(argv: list[str] | None = None) -> int:
    """Every failure a user can cause ends in one line on stderr and exit status 2 (1 for a
    bug); `--debug` or FLORIST_DEBUG=1 shows the traceback instead. Ctrl-C exits with 130."""
    # The florist command reports nothing home unless the user asks for it (their setting wins).
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("supernode", "superlink"):  # Flower's options pass through
        command = args.commands[args.command]
        options = [o for action in command._actions for o in action.option_strings]
        close = difflib.get_close_matches(extra[0].split("=")[0], options, n=1)
        command.error(f"unrecognized arguments: {' '.join(extra)}" + (f"; did you mean {close[0]}?" if close else ""))
    args.flower_args = extra
    debug = args.debug or os.environ.get("FLORIST_DEBUG", "") not in ("", "0")
    if args.command not in ("supernode", "superlink"):  # Flower's own processes take their signals themselves
        # From the start, not from a run's first round: a florist started with SIGINT ignored (`florist ... &` in a
        # script) would otherwise ignore a Ctrl-C sent during its preflight, and run to the end.
        interrupt_on_signals()
    try:
        return args.func(args)
    except KeyboardInterrupt as stop:  # runs raise `Interrupted`, which says what was kept
        ignore_signals()  # everything started is stopped: a late second signal must not cut the exit short
        print(f"florist: {str(stop) or 'interrupted'}", file=sys.stderr)
        return 130
    except Exception as err:
        if debug:
            raise
        if isinstance(err, USER_ERRORS):
            print(f"florist: error: {err}", file=sys.stderr)
            return 2
        print(f"florist: internal error: {type(err).__name__}: {err} (FLORIST_DEBUG=1 shows where)", file=sys.stderr)
        return 1
    finally:
        forget_interrupt()  # also where a command caught the interrupt itself (local-federation, join)


def run() -> None:
    """The `florist` command's entry point. After a Ctrl-C, everything florist started is stopped
    and what was finished is saved, so the process ends at once: tearing down the interpreter
    with torch, pandas and pyarrow loaded took another 2.5 s, half of the time a Ctrl-C took."""
    code = main()
    if code == 130:
        with contextlib.suppress(OSError):  # a reader that has gone (`florist ... | head`)
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
