"""`florist compare`: strategies × seeds on one scenario, one run after the other, and the
papers' table over them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from florist.apps.registry import STRATEGIES
from florist.cli.display import Bars
from florist.cli.options import count, launch, resource_options, runtime_option, scenario_options, track_option
from florist.runners import presets
from florist.server.report import pct, plural


def add(sub: argparse._SubParsersAction) -> None:
    cmp = sub.add_parser(
        "compare",
        help="run strategies × seeds on one scenario and write the papers' table",
        description="Run every strategy of --strategies with every seed of --seeds on one scenario, one after the "
        "other, each in OUT/<strategy>/seed<k> (a finished run with the same config is kept, an interrupted one "
        "resumes: it says which before it starts), then write OUT/compare.md (seen/unseen mean and bottom decile, "
        "mean ± std over seeds, kB and seconds per round), compare.json, compare.png and compare_rounds.png "
        "(every strategy's accuracy per round).",
    )
    cmp.add_argument("--strategies", help="comma-separated (default: all, or the preset's)")
    cmp.add_argument("--seeds", help="comma-separated (default: 1,2,3, or the preset's)")
    scenario_options(cmp)
    cmp.add_argument(
        "--num-clients", type=count, dest="num_nodes", help="simulated clients (default: 20, or the preset's)"
    )
    cmp.add_argument("--out", required=True, help="output folder")
    runtime_option(cmp, "the preset's, else ")
    cmp.add_argument(
        "--preset",
        metavar="NAME",
        help="a paper's main experiment: its strategies, seeds, clients and run config, with the paper's figures "
        "beside florist's in compare.md; flags given beside override it. NAME is one of "
        f"{', '.join(presets.names())} or a .toml file of your own (copy one from florist/presets/)",
    )
    cmp.add_argument(
        "--scale",
        choices=presets.SCALES,
        default="full",
        help="with --preset: full (the paper's dataset, model and sizes; needs its hub dataset and a GPU) or small "
        "(the same recipe on embedded data, minutes on a laptop). Default: full",
    )
    resource_options(cmp)
    track_option(cmp)
    cmp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    preset = presets.load(args.preset, args.scale) if args.preset else None
    _apply(args, preset)
    strategies, seeds = _names(args.strategies, "--strategies"), _seeds(args.seeds)
    runs = launch(args, preset.run_config if preset else {}, tuple(strategies))  # refused here, before torch

    from florist.runners import compare  # it imports torch and flwr

    paper = compare.Paper(preset.source(), preset.scale, preset.paper_values) if preset else None
    with RunBars() as bars:
        rows = compare.run_comparison(runs, Path(args.out), strategies, seeds, paper, bars)
    print(compare.text_table(rows))
    print(bars.tally())
    beside = "; the paper's figures beside florist's in compare.md" if paper else ""
    print(f"compare.md, compare.json, compare.png and compare_rounds.png in {args.out}/{beside}")
    return 0


class RunBars(Bars):
    """Which runs are kept, resumed and started, one line each on stderr before work starts;
    then two bars: the runs, and the rounds of the one under way."""

    def __init__(self) -> None:
        super().__init__()
        self.plan: dict[str, list[str]] = {}  # kept / resumed / started -> the runs' names
        self.resumed: dict[str, int] = {}  # name -> rounds done before

    def planned(self, kept: list[str], resumed: list[tuple[str, int]], started: list[str]) -> None:
        self.resumed = dict(resumed)
        described = [f"{name} after round {done}" for name, done in resumed]
        self.plan = {"kept": kept, "resumed": described, "started": started}
        lines = (
            ("keeps", "finished with this config", kept),
            ("resumes", "from its checkpoint", described),
            ("starts", "from round 1", started),
        )
        for verb, how, names in lines:
            if names:
                print(f"florist: {verb} {plural(len(names), 'run')} {how}: {', '.join(names)}", file=sys.stderr)

    def tally(self) -> str:
        """The plan's counts, for the summary at the end."""
        counts = ", ".join(f"{len(names)} {action}" for action, names in self.plan.items())
        return f"{plural(sum(map(len, self.plan.values())), 'run')}: {counts}"

    def started(self, runs: int, rounds: int) -> None:
        super().started(runs, rounds)
        self.runs, self.done = self.progress.add_task("runs", total=runs), 0
        self.rounds = self.progress.add_task("rounds", total=rounds)

    def run(self, strategy: str, seed: int, reused: bool) -> None:
        done = self.resumed.get(f"{strategy}/seed{seed}")
        how = ", kept" if reused else "" if done is None else f", resumed after round {done}"
        description = f"runs ({strategy}, seed {seed}{how})"
        self.progress.update(self.runs, completed=self.done, description=description)
        self.progress.update(self.rounds, completed=done or 0)
        self.done += 1

    def round(self, row: dict) -> None:
        self.progress.update(self.rounds, completed=row["round"])

    def finished(self, results: dict, seconds: float | None) -> None:
        """One line per run, above the bars on a terminal, alone where stderr is a file (no bars there)."""
        self.console.print(finished_line(results, seconds), highlight=False, markup=False, soft_wrap=True)

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None and exc[0] is None:  # every run done
            self.progress.update(self.runs, completed=self.done, description="runs")
        super().__exit__(*exc)


def finished_line(results: dict, seconds: float | None) -> str:
    """`florist: fedavg seed 1 done in 41.2 s: seen 93.8 %, unseen 95.2 %` (kept: `kept, ...`)."""
    summary = results["summary"]
    accuracy = ", ".join(
        f"{group} {pct(summary[group]['mean_accuracy'])} %"
        for group in ("seen", "unseen")
        if summary[group]["num_clients"]
    )
    how = "kept from before" if seconds is None else f"done in {seconds:.1f} s"
    return f"florist: {results['strategy']} seed {results['config']['seed']} {how}: {accuracy or 'no client scored'}"


def _apply(args: argparse.Namespace, preset: presets.Preset | None) -> None:
    """Fill the options the user left out from the preset, then from florist's defaults."""
    fallback = {
        "strategies": ",".join(STRATEGIES),
        "seeds": "1,2,3",
    }
    if preset:
        lists = {"strategies": ",".join(preset.strategies), "seeds": ",".join(map(str, preset.seeds))}
        fallback |= lists | {"num_nodes": preset.num_clients} | ({"runtime": preset.runtime} if preset.runtime else {})
    for name, value in fallback.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _names(text: str, option: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if unknown := [n for n in names if n not in STRATEGIES]:
        raise ValueError(f"{option}: unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}")
    if not names:
        raise ValueError(f"{option}: name at least one strategy")
    return names


def _seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()] or [1]
    except ValueError:
        raise ValueError(f"--seeds: expected comma-separated integers, got {text!r}") from None
