"""One table like the papers': strategies × partitions × seeds on the embedded digits, in
Flower simulation, seen and unseen clients, mean and bottom decile.

    python benchmarks/compare_strategies.py --out results/compare \
        [--strategies local fedavg fedavg-ft knnper] [--partitions pathological:2 dirichlet:0.3] \
        [--seeds 1 2] [--num-clients 20] [--rounds 30] [--run-config "eval-every=0"]

Costs are per training round as the run logged them (evaluation rounds included; the default
`eval-every=0` leaves evaluation out). FedAvg is not run separately when kNN-Per runs: kNN-Per trains exactly FedAvg's global model
(same seed, same rounds) and reports its per-client accuracy as `global_accuracy` (λ = 0), so
the FedAvg row is taken from there (`--strategies fedavg` runs it on its own instead).
Each run's results folder is kept under --out; the table goes to stdout and --out/table.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from florist.common.config import RunConfig, parse_overrides
from florist.common.metrics import summarize
from florist.server.simulation import simulate


def summaries(results: dict, key: str) -> dict[str, dict]:
    out = {}
    for group, seen in (("seen", True), ("unseen", False)):
        rows = [c for c in results["clients"] if c["seen"] == seen and c.get(key) is not None]
        out[group] = summarize([c[key] for c in rows], [c["num_test"] for c in rows])
    return out


def costs(results: dict) -> dict[str, float]:
    """Mean kB up / down and seconds per training round (evaluation rounds included)."""
    rounds = results["rounds"]
    mean = lambda key: float(np.mean([r[key] for r in rounds]))  # noqa: E731
    return {"kb_up": mean("bytes_up") / 1e3, "kb_down": mean("bytes_down") / 1e3, "seconds": mean("seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategies", nargs="+", default=["local", "fedavg", "fedavg-ft", "knnper"])
    parser.add_argument("--partitions", nargs="+", default=["pathological:2", "dirichlet:0.1", "dirichlet:0.3", "dirichlet:1.0"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--num-clients", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--run-config", default="eval-every=0")
    args = parser.parse_args()
    out = Path(args.out)
    derive_fedavg = "fedavg" in args.strategies and "knnper" in args.strategies
    to_run = [s for s in args.strategies if not (derive_fedavg and s == "fedavg")]

    table: dict[tuple[str, str], list[dict]] = {}
    for partition in args.partitions:
        for seed in args.seeds:
            for strategy in to_run:
                folder = out / f"{partition.replace(':', '-')}-seed{seed}" / strategy
                values = {"strategy": strategy, "partition": partition, "seed": seed, "min-nodes": args.num_clients,
                          "num-server-rounds": args.rounds, "results-dir": str(folder)} | parse_overrides(args.run_config)
                start = time.monotonic()
                results = simulate(RunConfig.from_mapping(values), args.num_clients)
                print(f"{partition} seed {seed} {strategy}: {time.monotonic() - start:.0f} s", flush=True)
                table.setdefault((partition, strategy), []).append(summaries(results, "accuracy") | costs(results))
                if derive_fedavg and strategy == "knnper":
                    derived = summaries(results, "global_accuracy") | costs(results)
                    table.setdefault((partition, "fedavg"), []).append(derived)

    lines = [f"{args.num_clients} clients, {args.rounds} rounds, seeds {args.seeds}: mean over seeds (± spread)", "",
             "| partition | strategy | seen mean | seen bottom 10% | unseen mean | unseen bottom 10% "
             "| kB up / round | kB down / round | s / round |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for partition in args.partitions:
        for strategy in args.strategies:
            runs = table.get((partition, strategy), [])
            cells = []
            for group in ("seen", "unseen"):
                for key in ("mean_accuracy", "bottom_decile_accuracy"):
                    values = np.array([r[group][key] for r in runs]) * 100
                    cells.append(f"{values.mean():.1f} ± {np.ptp(values) / 2:.1f}" if len(values) else "–")
            for key in ("kb_up", "kb_down", "seconds"):
                cells.append(f"{np.mean([r[key] for r in runs]):.1f}" if runs else "–")
            lines.append(f"| {partition} | {strategy} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    (out / "table.md").write_text(text + "\n")
    (out / "table.json").write_text(json.dumps({f"{p} {s}": v for (p, s), v in table.items()}, indent=1))


if __name__ == "__main__":
    main()
