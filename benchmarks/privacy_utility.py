"""The privacy/utility curve: FedAvg and kNN-Per on `mnist5k` under `dp` = none, central and local,
at each ε, over seeds: what the noise a budget needs costs in accuracy (docs/privacy.md). With
`--modes record`, record-level dp (DP-SGD on every node, ε per node): its ε is each node's, the
largest reported; `--strategies` also takes fedavg-ft, perfed-ckt, fedattn and local there, and
`--record-config` gives its rows their own run-config keys (DP-SGD's recommended settings, docs/privacy.md).

    python benchmarks/privacy_utility.py [--strategies fedavg knnper] [--modes none central local] \
        [--epsilons 1 3 8] [--seeds 1 2 3] [--rounds 20] [--dp-clip 1.0] [--lr 0.1] [--num-nodes 20] \
        [--partition dirichlet:0.3] [--os-noise] [--out DIR] [--json OUT] [--record-config 'KEY=VALUE ...']
    python benchmarks/privacy_utility.py --many-clients ...   # user-level dp over thousands of clients

In-process federations (florist/runners/inprocess.py) with the keys `florist simulate --runtime
in-process` sets (`model="lenet"`, as on mnist5k everywhere; lr 0.1, the step `lenet` is tuned for;
20 clients of which the default unseen-fraction holds 4 out, so a round samples all 16 seen ones:
q = 1), evaluated once, after the last round (`eval-every=0`). `none` runs once per seed (ε = ∞);
`central` and `local` once per ε and seed, σ calibrated to spend ε over the rounds. The noise is
seeded by the run's seed (`dp-noise-seed`), so the table reproduces; `--os-noise` draws it from the
operating system instead, as a deployment must. Each row: seen clients' mean accuracy ± std over
seeds, unseen clients' mean, kNN-Per's global model alone on the seen clients (its personalization
is the gap), ε spent (the last round's `dp_epsilon`: seeded noise promises nothing and reports
– there, `--os-noise` for a figure), σ, and over all rounds and seeds the nodes
whose training diverged on the noised model and sent no change (`dp_zeroed`) and the replies the
server refused (`failures`). About 35 s a run on 2 cores, the 42 runs of the grid 26 min. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import many_clients
import numpy as np

from florist.config import RunConfig, parse_overrides
from florist.runners.inprocess import run_in_process


def cells(args: argparse.Namespace) -> list[tuple[str, str, float]]:
    """The grid's (strategy, mode, ε): `none` at ε = ∞ alone, the others at each ε, loosest first."""
    epsilons = sorted(args.epsilons, reverse=True)
    return [
        (strategy, mode, eps)
        for strategy in args.strategies
        for mode in args.modes
        for eps in ([math.inf] if mode == "none" else epsilons)
    ]


def run(strategy: str, mode: str, eps: float, seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One in-process run; its figures as a row (`stopped`: why a run ended early or failed)."""
    folder = out / f"{strategy}-{mode}-{eps:g}-seed{seed}"
    values = {
        "strategy": strategy,
        "dataset": "mnist5k",
        "model": "lenet",
        "lr": args.lr,
        "partition": args.partition,
        "num-server-rounds": args.rounds,
        "eval-every": 0,
        "seed": seed,
        "results-dir": str(folder),
        "models-root": str(folder / "nodes"),  # as `simulate` keeps them: beside the results
    }
    if mode != "none":
        values |= {"dp": mode, "dp-epsilon": eps, "dp-noise-seed": 0 if args.os_noise else seed}
        values |= {"dp-clip": args.dp_clip} if args.dp_clip is not None else {}
    if mode == "record":
        values |= parse_overrides(args.record_config)
    row: dict[str, Any] = {"strategy": strategy, "dp": mode, "epsilon": eps, "seed": seed}
    start, cpu = time.perf_counter(), time.process_time()
    try:
        results = run_in_process(RunConfig.from_mapping(values), args.num_nodes)
    except (RuntimeError, ValueError) as err:  # a run that stops says why, in one line
        return row | {"stopped": str(err).splitlines()[0], "seconds": time.perf_counter() - start}
    last = results["rounds"][-1] if results["rounds"] else {}
    if mode == "record":  # each node's own ε: the largest the clients' rows say, σ the largest a node used
        spent = [c["dp_record_epsilon"] for c in results["clients"] if c.get("dp_record_epsilon") is not None]
        nodes = [n for r in results["rounds"] for n in r.get("dp_record_nodes", {}).values()]
        sigma = max((n["sigma"] for n in nodes), default=None)
        last = {"dp_epsilon": max(spent, default=None), "dp_noise_multiplier": sigma}
    return row | {
        "seen": results["summary"]["seen"]["mean_accuracy"],
        "unseen": results["summary"].get("unseen", {}).get("mean_accuracy"),
        "global_seen": global_accuracy(results["clients"], seen=True),
        "global_unseen": global_accuracy(results["clients"], seen=False),
        "epsilon_spent": last.get("dp_epsilon"),
        "sigma": last.get("dp_noise_multiplier"),
        "clipped": sum(r.get("dp_clipped", 0) for r in results["rounds"]),
        "zeroed": sum(r.get("dp_zeroed", 0) for r in results["rounds"]),
        "failures": len(results["failures"]),
        "stopped": results.get("stopped") or ("" if results["complete"] else "incomplete"),
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu,  # this process's CPU time: the machine may be shared
        "load": os.getloadavg()[0],  # the 1-minute load average as the run ended
    }


def global_accuracy(clients: list[dict[str, Any]], seen: bool) -> float | None:
    """The global model's accuracy alone over the seen (or unseen) clients, weighted by their test
    splits as the summary's means are; None where the clients report none (FedAvg)."""
    group = [c for c in clients if c["seen"] == seen and c.get("global_accuracy") is not None]
    if not group:
        return None
    return float(np.average([c["global_accuracy"] for c in group], weights=[c["num_test"] for c in group]))


def pct(values: list[float | None], spread: bool = False) -> str:
    """Mean (± std over seeds) in %; – where no run has the figure."""
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    text = f"{100 * np.mean(values):.1f}"
    return text + (f" ± {100 * np.std(values):.1f}" if spread and len(values) > 1 else "")


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """One line per (strategy, mode, ε), over its seeds."""
    lines = [
        "| strategy | dp | ε | seen mean | unseen mean | global model, seen | ε spent | σ | zeroed | failures | runs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for strategy, mode, eps in cells(args):
        group = [r for r in rows if (r["strategy"], r["dp"], r["epsilon"]) == (strategy, mode, eps)]
        done = [r for r in group if "seen" in r]
        spent = [r["epsilon_spent"] for r in done if r["epsilon_spent"] is not None]
        sigma = [r["sigma"] for r in done if r["sigma"] is not None]
        lines.append(
            f"| {strategy} | {mode} | {'∞' if math.isinf(eps) else f'{eps:g}'} "
            f"| {pct([r['seen'] for r in done], spread=True)} | {pct([r['unseen'] for r in done])} "
            f"| {pct([r['global_seen'] for r in done])} | {f'{max(spent):.3g}' if spent else '–'} "
            f"| {f'{np.mean(sigma):.3g}' if sigma else '–'} | {sum(r['zeroed'] for r in done)} "
            f"| {sum(r['failures'] for r in done)} | {len(done)}/{len(group)} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    strategies = ("fedavg", "knnper", "fedavg-ft", "perfed-ckt", "fedattn", "local")  # the last four: record only
    parser.add_argument("--strategies", nargs="+", choices=strategies, default=["fedavg", "knnper"])
    parser.add_argument(
        "--modes", nargs="+", choices=("none", "central", "local", "record"), default=["none", "central", "local"]
    )
    parser.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 3.0, 8.0], help="for every mode but none")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--dp-clip", type=float, default=None, help="C (default: the run config's dp-clip)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--num-nodes", type=int, default=20)
    parser.add_argument("--partition", default="dirichlet:0.3")
    parser.add_argument("--os-noise", action="store_true", help="noise from the OS's entropy, not seeded by the seed")
    parser.add_argument("--out", default="", help="where the runs' folders go (default: a new temporary folder)")
    parser.add_argument(
        "--json", default="", metavar="OUT", help="also write every run's row to this file (rewritten after each run)"
    )
    parser.add_argument(
        "--record-config",
        default="",
        metavar="'KEY=VALUE ...'",
        help="run-config keys of the record rows only, over the others (e.g. 'batch-size=64 lr=1.0 local-epochs=3')",
    )
    parser.add_argument(
        "--from-json",
        nargs="+",
        default=[],
        metavar="JSON",
        help="run nothing: table the runs these --json files hold (grids run side by side), as the flags select",
    )
    many_clients.add_arguments(parser)
    args = parser.parse_args()
    if args.many_clients:  # the many-clients user-level rows: benchmarks/many_clients.py
        return many_clients.main(args)
    if args.from_json:
        runs = [r for name in args.from_json for r in json.loads(Path(name).read_text())["runs"]]
        runs = [r | {"epsilon": math.inf if r["epsilon"] is None else r["epsilon"]} for r in runs]  # null: ∞
        print("\n".join(table(runs, args)))
        return
    user_level = set(args.modes) & {"central", "local"}
    if user_level and (uncovered := set(args.strategies) - {"fedavg", "knnper", "fedavg-ft"}):
        modes, names = " ".join(sorted(user_level)), ", ".join(sorted(uncovered))
        parser.error(f"--modes {modes} covers no {names}: use --modes none record")
    out = Path(args.out or tempfile.mkdtemp(prefix="florist-privacy-utility-"))
    logging.getLogger("flwr").setLevel(logging.WARNING)  # as `simulate` in process: the rows say how far it got
    rows = []
    for strategy, mode, eps in cells(args):
        for seed in args.seeds:
            rows.append(run(strategy, mode, eps, seed, args, out))
            r = rows[-1]
            figures = f"seen {pct([r['seen']])} %, zeroed {r['zeroed']}" if "seen" in r else "no result"
            print(
                f"{strategy} {mode} ε={eps:g} seed {seed}: {figures}; {r['seconds']:.0f} s {r['stopped']}", flush=True
            )
            write_json(rows, args)  # as it goes: a grid cut short keeps its finished runs
    clip = args.dp_clip if args.dp_clip is not None else RunConfig.__dataclass_fields__["dp_clip"].default
    print(
        f"\nmnist5k, lenet, lr {args.lr:g}, {args.partition}, {args.num_nodes} clients (20% unseen), "
        f"{args.rounds} rounds, dp-clip {clip:g}, δ = 1e-5, seeds {', '.join(map(str, args.seeds))}; "
        f"noise {'from the OS' if args.os_noise else 'seeded by the seed'}; accuracies %, mean (± std) over seeds; "
        "zeroed and failures summed over rounds and seeds; runs: those that finished, of those made\n"
    )
    print("\n".join(table(rows, args)))
    print(f"\n{np.mean([r['seconds'] for r in rows]):.1f} s a run on average, runs in {out}")


def write_json(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Every run's row so far to `--json` (when given), the settings beside them."""
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        runs = [r | {"epsilon": None if math.isinf(r["epsilon"]) else r["epsilon"]} for r in rows]  # ∞: null
        Path(args.json).write_text(json.dumps({"settings": settings, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
