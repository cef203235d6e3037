"""`florist compare`: every strategy × seed on one scenario, then the papers' table.

Each run has its own results folder under the output folder (`<strategy>/seed<k>`), so the
comparison can be stopped and started again: a finished run with the same config is kept, an
interrupted one resumes from its checkpoint, and the comparison says which before it starts
(`plan`). `compare.md` holds the table (seen and unseen mean and bottom decile as mean ± std
over seeds, kB per round, seconds per round), `compare.json` the same figures, the per-run
summaries and the per-round series, `compare.png` the bars with error bars, `compare_rounds.png`
every strategy's accuracy per round side by side.
"""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from florist.config import RunConfig
from florist.runners import raycluster, simulation
from florist.runners.launch import Events, Launch
from florist.runners.preflight import preflight, run_config
from florist.runners.simulation import decode_data, run_simulated
from florist.server.checkpoint import FILE as CHECKPOINT
from florist.server.checkpoint import Checkpoint
from florist.server.report import pyplot, save
from florist.server.results import jsonable

Runner = Callable[[RunConfig, int], dict[str, Any]]
GROUPS = ("seen", "unseen")
FIGURES = ("mean_accuracy", "bottom_decile_accuracy")


def run_comparison(
    launch: Launch, out: Path, strategies: list[str], seeds: list[int], paper: Paper | None, events: Events
) -> dict[str, dict[str, Any]]:
    """Every strategy of `strategies` with every seed of `seeds` on the launch's scenario, all
    checked before the first starts, one after the other (`compare`); then the table in `out`
    (`write`), whose rows it returns."""
    simulation.require_ray(launch.runtime)
    address = raycluster.address_of(launch.ray_address, launch.runtime)
    base, num_nodes = run_config(launch)  # num-classes from a folder's class folders, as simulate's
    resources = simulation.client_resources(launch.cpus_per_client, launch.gpus_per_client, cluster=bool(address))
    out = out.expanduser().absolute()
    values = {"min-nodes": num_nodes} | dict(launch.values) | {"num-classes": base.num_classes}
    configs = run_configs(out, strategies, seeds, values)
    checked = [preflight(cfg, num_nodes, devices_here=not address) for cfg in configs]
    for warning in sorted({w for run in checked for w in run.warnings}):  # each doubt once
        events.warning(warning)
    runs = plan(configs)
    events.planned(
        [r.name for r in runs if r.action == "kept"],
        [(r.name, r.resumed_after) for r in runs if r.resumed_after is not None],
        [r.name for r in runs if r.action == "started"],
    )
    events.started(len(configs), configs[0].num_server_rounds)
    for cfg in configs:
        decode_data(cfg, num_nodes, events)

    def runner(cfg: RunConfig, num_nodes: int) -> dict[str, Any]:
        return run_simulated(launch.runtime, cfg, num_nodes, events.round, resources, address)

    all_results = compare(
        runs, num_nodes, runner, lambda r: events.run(r.cfg.strategy, r.cfg.seed, r.action == "kept"), events.finished
    )
    return write(out, all_results, scenario_line(configs[0], num_nodes), paper)


def scenario_line(cfg: RunConfig, num_nodes: int) -> str:
    """The scenario every run of a comparison shares, in words (the table's title)."""
    return (
        f"dataset {cfg.dataset}, partition {cfg.partition}, shift {cfg.shift}, {num_nodes} clients, "
        f"{cfg.num_server_rounds} rounds, unseen fraction {cfg.unseen_fraction}"
    )


def run_folder(out: Path, strategy: str, seed: int) -> Path:
    return out / strategy / f"seed{seed}"


def run_configs(out: Path, strategies: list[str], seeds: list[int], values: Mapping[str, Any]) -> list[RunConfig]:
    """The run configs of the comparison, checked before any run starts. Their trackers write
    to `out` (unless `values` say where): TensorBoard's runs side by side, one MLflow experiment
    and one W&B group named after it, a tracker run per strategy and seed."""
    return [
        RunConfig.from_mapping(
            {"tracking-dir": str(out)}
            | dict(values)
            | {"strategy": s, "seed": seed, "results-dir": str(run_folder(out, s, seed))}
            | ({} if "models-root" in values else {"models-root": str((run_folder(out, s, seed) / "nodes").absolute())})
        )
        for s in strategies
        for seed in seeds
    ]


def finished(cfg: RunConfig) -> dict[str, Any] | None:
    """The results of `cfg`'s run when its folder holds them complete, with this config as
    results.json writes it (inf as null: dp-epsilon when not given), a run that was
    resumed to its end too (its `resume-from` is where, not what, it computed)."""
    path = Path(cfg.results_dir) / "results.json"
    try:
        results = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    config = results.get("config")
    same = isinstance(config, dict) and config | {"resume-from": cfg.resume_from} == jsonable(cfg.to_mapping())
    return results if results.get("complete") and same else None


@dataclasses.dataclass(frozen=True)
class Planned:
    """A run of the comparison and what this start does with it: keep its finished `results`,
    resume it after round `resumed_after` (`cfg` then resumes from its checkpoint), or start it."""

    cfg: RunConfig
    results: dict[str, Any] | None = None
    resumed_after: int | None = None

    @property
    def name(self) -> str:
        return f"{self.cfg.strategy}/seed{self.cfg.seed}"

    @property
    def action(self) -> str:
        if self.results is not None:
            return "kept"
        return "started" if self.resumed_after is None else "resumed"


def plan(configs: list[RunConfig]) -> list[Planned]:
    """What each config's folder lets this start do: keep a finished run with the same config,
    resume one cut after a round from its checkpoint of the same config, else start over. Decided
    for all before the first run, so the user hears it before waiting for anything."""
    return [_plan_one(cfg) for cfg in configs]


def _plan_one(cfg: RunConfig) -> Planned:
    if (results := finished(cfg)) is not None:
        return Planned(cfg, results=results)
    folder = Path(cfg.results_dir)
    if not (folder / CHECKPOINT).is_file():
        return Planned(cfg)
    try:
        checkpoint = Checkpoint.load(folder)
        checkpoint.refuse_differences(cfg.to_mapping(), folder)
    except ValueError:  # another config or format: start over
        return Planned(cfg)
    return Planned(cfg.replace(resume_from=str(folder)), resumed_after=checkpoint.round)


def compare(
    runs: list[Planned],
    num_nodes: int,
    runner: Runner,
    on_run: Callable[[Planned], None],
    on_done: Callable[[dict[str, Any], float | None], None] = lambda results, seconds: None,
) -> list[dict[str, Any]]:
    """Run (or keep) every planned run; `on_run(run)` before each, `on_done(results, seconds)`
    after (None seconds: kept). Returns their results."""
    all_results = []
    for run in runs:
        on_run(run)
        began = time.monotonic()
        results = run.results if run.results is not None else runner(run.cfg, num_nodes)
        on_done(results, None if run.results is not None else time.monotonic() - began)
        all_results.append(results)
    return all_results


def table(all_results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per strategy: mean and std over seeds of each group's mean and bottom decile, and the
    mean kB up / down and seconds per round."""
    by_strategy: dict[str, list[dict[str, Any]]] = {}
    for results in all_results:
        by_strategy.setdefault(results["strategy"], []).append(results)
    rows = {}
    for strategy, runs in by_strategy.items():
        row: dict[str, Any] = {
            "seeds": [r["config"]["seed"] for r in runs],
            "scored": sum(any(r["summary"][g]["num_clients"] for g in GROUPS) for r in runs),
        }
        for group in GROUPS:
            for figure in FIGURES:
                values = [r["summary"][group][figure] for r in runs if r["summary"][group]["num_clients"]]
                row[f"{group}_{figure}"] = _mean_std(values)
        per_round = lambda key: float(np.mean([np.mean([x[key] for x in r["rounds"]]) for r in runs if r["rounds"]]))  # noqa: E731
        row |= {
            "kb_up": per_round("bytes_up") / 1e3,
            "kb_down": per_round("bytes_down") / 1e3,
            "seconds": per_round("seconds"),
        }
        rows[strategy] = row
    return rows


def _mean_std(values: list[float]) -> list[float | None]:
    """[mean, std] over runs; no spread from one run (None), nothing from none."""
    if not values:
        return [None, None]
    return [float(np.mean(values)), float(np.std(values)) if len(values) > 1 else None]


@dataclasses.dataclass(frozen=True)
class Paper:
    """What a preset's paper reports, to print beside florist's figures."""

    source: str  # the paper and its table, in words
    scale: str  # full: the paper's own setting; small: the recipe on other data, for reference only
    values: dict[str, dict[str, float]]  # strategy -> {"seen": %, "unseen": %}


def paper_lines(rows: dict[str, dict[str, Any]], paper: Paper) -> list[str]:
    """The paper's figures beside florist's, strategy by strategy (– where either has none)."""
    caveat = (
        "the paper's own setting"
        if paper.scale == "full"
        else "florist ran the recipe at --scale small (other data, smaller model): the paper's figures are "
        "the reference, not the target"
    )
    lines = [
        "",
        f"## The paper's figures: {paper.source}",
        "",
        f"Client mean test accuracy (%); {caveat}.",
        "",
        "| strategy | paper seen | florist seen | paper unseen | florist unseen |",
        "|---|---:|---:|---:|---:|",
    ]
    for strategy in dict.fromkeys([*paper.values, *rows]):
        reported, row = paper.values.get(strategy, {}), rows.get(strategy)
        cells = []
        for group in GROUPS:
            cells.append(f"{reported[group]:.1f}" if group in reported else "–")
            cells.append(_pct(row[f"{group}_mean_accuracy"]) if row else "not run")
        lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
    return lines


def markdown(rows: dict[str, dict[str, Any]], scenario: str, paper: Paper | None = None) -> str:
    lines = [
        f"# florist compare: {scenario}",
        "",
        "Mean ± std over seeds of the per-run client means (%), costs per round; runs: those that scored "
        "clients, of those made (a figure from one run has no ±).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|" + "---:|" * (len(COLUMNS) - 1),
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_cells(rows)]
    if paper:
        lines += paper_lines(rows, paper)
    lines += [
        "",
        "![seen and unseen mean accuracy per strategy](compare.png)",
        "",
        "![seen clients' mean accuracy per round, one line per strategy: mean over seeds, band from the lowest to "
        "the highest seed](compare_rounds.png)",
    ]
    return "\n".join(lines) + "\n"


COLUMNS = (
    "strategy",
    "runs",
    "seen mean",
    "seen bottom 10%",
    "unseen mean",
    "unseen bottom 10%",
    "kB up",
    "kB down",
    "s",
)


def table_cells(rows: dict[str, dict[str, Any]]) -> list[list[str]]:
    """The table's cells, a list per strategy in COLUMNS' order."""
    return [
        [strategy, _runs(row), *(_pct(row[f"{g}_{f}"]) for g in GROUPS for f in FIGURES)]
        + [f"{row['kb_up']:,.1f}", f"{row['kb_down']:,.1f}", f"{row['seconds']:.2f}"]
        for strategy, row in rows.items()
    ]


def text_table(rows: dict[str, dict[str, Any]]) -> str:
    """The table as plain text in aligned columns, for a terminal or a log file alike: the
    strategy left, the figures right."""
    lines = [list(COLUMNS), *table_cells(rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))).rstrip()
        for line in lines
    )


def _runs(row: dict[str, Any]) -> str:
    made, scored = len(row["seeds"]), row["scored"]
    return str(made) if scored == made else f"{scored} of {made}"


def _pct(pair: list[float | None]) -> str:
    mean, std = pair
    if mean is None:
        return "–"
    return f"{100 * mean:.1f}" if std is None else f"{100 * mean:.1f} ± {100 * std:.1f}"


def plot(rows: dict[str, dict[str, Any]], scenario: str, path: Path) -> None:
    save(figure(rows, scenario), path)


def figure(rows: dict[str, dict[str, Any]], scenario: str):
    """Seen and unseen mean accuracy per strategy with the seeds' standard deviation; the
    scenario line, long as it is, wrapped to the figure's width."""
    fig, ax = pyplot().subplots(figsize=(max(6, 1.1 * len(rows)), 3.8))
    x, width = np.arange(len(rows)), 0.38
    for i, group in enumerate(GROUPS):
        pairs = [row[f"{group}_mean_accuracy"] for row in rows.values()]
        means = [100 * (m if m is not None else np.nan) for m, _ in pairs]
        stds = [100 * (s or 0.0) for _, s in pairs]
        ax.bar(x + (i - 0.5) * width, means, width, yerr=stds, capsize=3, label=group)
    ax.set_xticks(x, list(rows), rotation=20)
    _title(ax, f"florist compare: {scenario}")
    ax.set(ylabel="client mean accuracy (%)", ylim=(0, 100))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the axes: bars near 100 % ran under it
    ax.grid(alpha=0.3, axis="y")
    return fig


def _title(ax, text: str) -> None:
    """`text` as the axes' title, wrapped to the figure's width (a scenario line is long)."""
    columns = int(ax.figure.get_figwidth() * 9)  # characters of a 10-point title per inch
    ax.set_title(textwrap.fill(text, columns), fontsize=10)


def round_series(all_results: list[dict[str, Any]]) -> dict[str, dict[str, list]]:
    """Per strategy, the lines of compare_rounds.png: each evaluated round (`round`) with the
    seen clients' mean accuracy of its runs (results.json's per-round `accuracy`): their mean,
    lowest and highest over the seeds that evaluated it, and how many did (`seeds`)."""
    by_strategy: dict[str, dict[int, list[float]]] = {}
    for results in all_results:
        rounds = by_strategy.setdefault(results["strategy"], {})
        for row in results["rounds"]:
            if row.get("accuracy") is not None and math.isfinite(row["accuracy"]):
                rounds.setdefault(row["round"], []).append(row["accuracy"])
    series = {}
    for strategy, rounds in by_strategy.items():
        order = sorted(rounds)
        series[strategy] = {
            "round": order,
            "mean": [float(np.mean(rounds[r])) for r in order],
            "min": [min(rounds[r]) for r in order],
            "max": [max(rounds[r]) for r in order],
            "seeds": [len(rounds[r]) for r in order],
        }
    return series


def rounds_figure(series: dict[str, dict[str, list]], scenario: str):
    """Every strategy's seen-client mean accuracy per round, one line each (the mean over seeds,
    a band from the lowest to the highest seed where there are several), on report.md's fixed
    0-100 % axis with whole-round ticks; the legend outside the axes, where it hides no line."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = pyplot().subplots(figsize=(7.5, 4))
    for strategy, s in series.items():
        (line,) = ax.plot(s["round"], [100 * v for v in s["mean"]], marker=".", label=strategy)
        if any(n > 1 for n in s["seeds"]):
            low, high = [100 * v for v in s["min"]], [100 * v for v in s["max"]]
            ax.fill_between(s["round"], low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="round", ylabel="seen-client mean accuracy (%)", ylim=(0, 100))
    _title(ax, f"accuracy per round (mean over seeds, band: min–max): {scenario}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def write(
    out: Path, all_results: list[dict[str, Any]], scenario: str, paper: Paper | None = None
) -> dict[str, dict[str, Any]]:
    """compare.md, compare.json, compare.png and compare_rounds.png in `out`; returns the table's rows."""
    rows, series = table(all_results), round_series(all_results)
    (out / "compare.md").write_text(markdown(rows, scenario, paper))
    runs = [{"strategy": r["strategy"], "seed": r["config"]["seed"], "summary": r["summary"]} for r in all_results]
    figures = {"scenario": scenario, "rows": rows, "runs": runs, "per_round": series} | (
        {"paper": dataclasses.asdict(paper)} if paper else {}
    )
    (out / "compare.json").write_text(json.dumps(figures, indent=1))
    plot(rows, scenario, out / "compare.png")
    save(rounds_figure(series, scenario), out / "compare_rounds.png")
    return rows
