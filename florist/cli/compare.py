"""`florist compare`: strategies × seeds on one scenario, one run after the other, and the
papers' table over them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from florist.cli.options import (
    chosen_runtime,
    count,
    decode_data,
    given,
    resource_options,
    run_simulated,
    runtime_option,
    scenario_options,
    stderr_console,
    track_option,
)
from florist.cli.signals import interrupt_on_signals
from florist.common import devices
from florist.config import RunConfig
from florist.runners import presets
from florist.strategies import STRATEGIES


def add(sub: argparse._SubParsersAction) -> None:
    cmp = sub.add_parser(
        "compare",
        help="run strategies × seeds on one scenario and write the papers' table",
        description="Run every strategy of --strategies with every seed of --seeds on one scenario, one after the "
        "other, each in OUT/<strategy>/seed<k> (a finished run with the same config is kept, an interrupted one "
        "resumes), then write OUT/compare.md (seen/unseen mean and bottom decile, mean ± std over seeds, kB and "
        "seconds per round), compare.json and compare.png.",
    )
    cmp.add_argument("--strategies", help="comma-separated (default: all, or the preset's)")
    cmp.add_argument("--seeds", help="comma-separated (default: 1,2,3, or the preset's)")
    scenario_options(cmp)
    cmp.add_argument("--num-clients", type=count, help="simulated clients (default: 20, or the preset's)")
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
    from florist.runners import compare, raycluster
    from florist.runners.simulation import client_resources

    preset = presets.load(args.preset, args.scale) if args.preset else None
    _apply(args, preset)
    args.ray_address = raycluster.address_of(args.ray_address, args.runtime)
    strategies, seeds = _names(args.strategies, "--strategies"), _seeds(args.seeds)
    values = {"min-nodes": args.num_clients} | (preset.run_config if preset else {}) | given(args)
    resources = client_resources(args.cpus_per_client, args.gpus_per_client, cluster=bool(args.ray_address))
    configs = compare.planned(Path(args.out).expanduser().absolute(), strategies, seeds, values)
    _check(configs, args.num_clients, on_cluster=bool(args.ray_address))
    cfg0 = configs[0]
    scenario = (
        f"dataset {cfg0.dataset}, partition {cfg0.partition}, shift {cfg0.shift}, {args.num_clients} clients, "
        f"{cfg0.num_server_rounds} rounds, unseen fraction {cfg0.unseen_fraction}"
    )
    interrupt_on_signals()
    all_results = _run_all(args, configs, resources)
    paper = compare.Paper(preset.source(), preset.scale, preset.paper_values) if preset else None
    compare.write(Path(args.out), all_results, scenario, paper)
    print((Path(args.out) / "compare.md").read_text())
    print(f"compare.md, compare.json and compare.png in {args.out}/")
    return 0


def _apply(args: argparse.Namespace, preset: presets.Preset | None) -> None:
    """Fill the options the user left out from the preset, then from florist's defaults."""
    fallback = {
        "strategies": ",".join(STRATEGIES),
        "seeds": "1,2,3",
        "num_clients": 20,
        "runtime": chosen_runtime(args),
    }
    if preset:
        lists = {"strategies": ",".join(preset.strategies), "seeds": ",".join(map(str, preset.seeds))}
        fallback |= (
            lists | {"num_clients": preset.num_clients} | ({"runtime": preset.runtime} if preset.runtime else {})
        )
    for name, value in fallback.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _check(configs: list[RunConfig], num_clients: int, on_cluster: bool) -> None:
    """Refuse before any run starts what cannot work; warn once about what is doubtful. A Ray
    cluster's nodes (`on_cluster`) have devices of their own."""
    from florist.runners.preflight import check_run

    if not on_cluster:
        devices.resolve(configs[0].device, "device")
    warnings = {w for cfg in configs for w in check_run(cfg, num_clients)}
    for warning in sorted(warnings):
        print(f"florist: warning: {warning}", file=sys.stderr)


def _run_all(args: argparse.Namespace, configs: list[RunConfig], resources: dict[str, Any]) -> list[dict[str, Any]]:
    """Every planned run, one after the other, under two progress bars: runs and rounds."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from florist.runners import compare

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=stderr_console(),
    ) as progress:
        runs = progress.add_task("runs", total=len(configs))
        rounds = progress.add_task("rounds", total=configs[0].num_server_rounds)

        for cfg in configs:
            decode_data(progress, cfg, args.num_clients)

        def on_run(cfg: RunConfig, reused: bool) -> None:
            done = configs.index(cfg)
            progress.update(
                runs, completed=done, description=f"runs ({cfg.strategy}, seed {cfg.seed}{', kept' * reused})"
            )
            progress.update(rounds, completed=0)

        def runner(cfg: RunConfig, num_clients: int) -> dict[str, Any]:
            on_round = lambda row: progress.update(rounds, completed=row["round"])  # noqa: E731
            return run_simulated(args.runtime, cfg, num_clients, on_round, resources, args.ray_address)

        all_results = compare.compare(configs, args.num_clients, runner, on_run)
        progress.update(runs, completed=len(configs), description="runs")
    return all_results


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
