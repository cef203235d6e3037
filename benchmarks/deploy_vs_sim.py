"""Seconds per round and per exchange: the same run in Flower simulation, between real
processes with florist's warm executor, and between real processes with Flower's own
per-message executor, side by side in one run.

    python benchmarks/deploy_vs_sim.py [--nodes 3] [--rounds 4] [--strategies fedavg pefll]

For each strategy it prints seconds per round and, per exchange (message type), the median
exchange time and its overhead: exchange time minus the slowest node's handler time, i.e. what
the runtime adds (polling, object transfers, process start). Rounds after the first only (the
first pays start-up costs). Nothing is asserted; it also says whether every client's accuracy
is identical in the three runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

from scratch import work_folder

from florist.config import RunConfig
from florist.deploy.federation import LocalFederation
from florist.runners.simulation import simulate

RUNTIMES = ("simulation", "warm", "flower")


def deploy(work: Path, executor: str, values: dict, nodes: int) -> dict:
    configs = [
        {"partition-id": i, "num-partitions": nodes, "state-dir": str(work / executor / "state")} for i in range(nodes)
    ]
    with LocalFederation(work / executor / "federation", configs, executor=executor) as fed:
        command = fed.run_command(values | {"results-dir": str(work / executor / "out")})
        subprocess.run(command, env=fed.env, check=True, capture_output=True)
    return json.loads((work / executor / "out" / "results.json").read_text())


def figures(results: dict) -> dict:
    """Median seconds per round and, per exchange type, median seconds and overhead."""
    rounds = results["rounds"][1:]
    exchanges = [e for r in rounds for e in r["exchanges"]]
    per_type = {}
    for kind in dict.fromkeys(e["type"] for e in exchanges):
        rows = [e for e in exchanges if e["type"] == kind]
        per_type[kind] = (
            statistics.median(e["seconds"] for e in rows),
            statistics.median(e["seconds"] - e["handler_seconds_max"] for e in rows),
        )
    return {
        "round": statistics.median(r["seconds"] for r in rounds),
        "exchange": statistics.median(e["seconds"] for e in exchanges),
        "overhead": statistics.median(e["seconds"] - e["handler_seconds_max"] for e in exchanges),
        "types": per_type,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--strategies", nargs="+", default=["fedavg", "pefll"])
    parser.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=RUNTIMES)
    args = parser.parse_args()
    with work_folder("florist-bench-") as work:
        print(
            f"{args.nodes} nodes, {args.rounds} rounds, iid digits, every round evaluated; "
            f"medians of rounds 2..{args.rounds}"
        )
        for strategy in args.strategies:
            values = {
                "strategy": strategy,
                "num-server-rounds": args.rounds,
                "partition": "iid",
                "min-nodes": args.nodes,
                "unseen-fraction": 0.0,
            }
            runs = {}
            for runtime in args.runtimes:
                if runtime == "simulation":
                    cfg = RunConfig.from_mapping(values | {"results-dir": str(work / strategy / "simulation")})
                    runs[runtime] = simulate(cfg, args.nodes)
                else:
                    runs[runtime] = deploy(work / strategy, runtime, values, args.nodes)
            stats = {runtime: figures(results) for runtime, results in runs.items()}
            base = stats.get("simulation", {}).get("round")
            print(f"\n{strategy}")
            print(
                f"  {'runtime':<12}{'s/round':>9}{'× sim':>8}{'s/exchange':>12}{'overhead':>10}"
                f"   per exchange type (s, overhead)"
            )
            for runtime, s in stats.items():
                ratio = f"{s['round'] / base:7.1f}×" if base else "      –"
                kinds = ", ".join(f"{k} {t:.2f} ({o:.2f})" for k, (t, o) in s["types"].items())
                print(f"  {runtime:<12}{s['round']:9.2f}{ratio}{s['exchange']:12.2f}{s['overhead']:10.2f}   {kinds}")
            if "warm" in stats and "flower" in stats:
                print(
                    f"  warm is {stats['flower']['exchange'] / stats['warm']['exchange']:.1f}× faster "
                    "per exchange than flower"
                )
            accuracies = {
                runtime: [(c["client"], c["accuracy"]) for c in results["clients"]] for runtime, results in runs.items()
            }
            print(
                f"  per-client accuracies identical in {', '.join(accuracies)}: "
                f"{len(set(map(str, accuracies.values()))) == 1}"
            )


if __name__ == "__main__":
    main()
