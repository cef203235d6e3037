"""What an experiment tracker costs a run: time per round, start-up and end, with no tracker,
with each one and with all three, measured side by side in one process (the variants take
turns, `--repeats` times).

    XDG_CACHE_HOME=$(mktemp -d) python benchmarks/tracking.py [--clients 5] [--rounds 10] \\
        [--repeats 2] [--runtime in-process|simulation]

The same FedAvg run on the embedded digits for every variant, each in a results folder of its
own, W&B offline. A round's time is the wall time between the ends of two rounds as the
ServerApp sees them (training, evaluation, checkpoint and the trackers' logging: `on_round` is
called after the trackers got the round); "to round 1" runs from the call to the end of the
first round (data, the trackers' start: imports, MLflow's new database, W&B's service), "end"
from the last round to the returned results (final evaluation, report, the trackers' summary
and artifacts), the trackers' imports aside: a warm-up run of each variant pays them first, and
they are timed apart, in fresh processes. `--runtime simulation` runs Flower's simulation (Ray)
in this process instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

VARIANTS = ("", "tensorboard", "mlflow", "wandb", "tensorboard,mlflow,wandb")
# What each tracker imports, in a fresh process that has florist's server loaded (the variants
# below share one process, so only the first run of each pays its import).
IMPORTS = {
    "tensorboard": "from torch.utils.tensorboard import SummaryWriter",
    "mlflow": "from mlflow.tracking import MlflowClient",
    "wandb": "import wandb",
}


def import_seconds(statement: str) -> float:
    """Seconds `statement` takes in a fresh Python that has florist's ServerApp imported."""
    import subprocess
    import sys

    timed = f"import florist.apps.server, time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", timed], capture_output=True, text=True, check=True).stdout)


def one_run(trackers: str, folder: Path, clients: int, rounds: int, runtime: str) -> dict[str, float]:
    """One run's timings: seconds to the end of round 1, per later round (median), at the end."""
    from florist.config import RunConfig

    cfg = RunConfig.from_mapping(
        {
            "strategy": "fedavg",
            "num-server-rounds": rounds,
            "min-nodes": clients,
            "results-dir": str(folder),
            "trackers": trackers,
        }
    )
    ends: list[float] = []
    start = time.perf_counter()
    if runtime == "in-process":
        from florist.runners.inprocess import run_in_process

        run_in_process(cfg, clients, on_round=lambda row: ends.append(time.perf_counter()))
    else:
        from florist.runners.simulation import simulate

        simulate(cfg, clients, on_round=lambda row: ends.append(time.perf_counter()))
    finish = time.perf_counter()
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return {"first": ends[0] - start, "round": statistics.median(gaps), "end": finish - ends[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--runtime", choices=("in-process", "simulation"), default="in-process")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # each variant's own store, in its results folder
    import logging

    import florist.apps.server  # noqa: F401  (Flower sets its logger's level when imported)

    logging.getLogger("flwr").setLevel(logging.WARNING)
    imports = {name: statistics.median(import_seconds(s) for _ in range(3)) for name, s in IMPORTS.items()}
    measured: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as scratch:
        for variant in VARIANTS:  # the imports (and the data's decoding), once, before anything is timed
            one_run(variant, Path(scratch) / f"warm-up-{variant.replace(',', '+')}", args.clients, 2, args.runtime)
        for repeat in range(args.repeats):
            for variant in VARIANTS:
                folder = Path(scratch) / f"{variant.replace(',', '+') or 'none'}-{repeat}"
                measured[variant].append(one_run(variant, folder, args.clients, args.rounds, args.runtime))
    print(
        f"FedAvg, {args.clients} clients, {args.rounds} rounds, {args.runtime}, "
        f"median of {args.repeats} run(s) per variant; seconds (difference to no tracker)"
    )
    base = {k: statistics.median(m[k] for m in measured[""]) for k in ("first", "round", "end")}
    print(f"{'trackers':<28}{'to round 1':>18}{'per round':>20}{'end':>18}")
    for variant, runs in measured.items():
        cells = []
        for key, width in (("first", 18), ("round", 20), ("end", 18)):
            value = statistics.median(m[key] for m in runs)
            delta = f" ({value - base[key]:+.3f})" if variant else ""
            cells.append(f"{value:.3f}{delta}".rjust(width))
        print(f"{variant or 'none':<28}" + "".join(cells))
    print("import, once per server process: " + ", ".join(f"{n} {s:.2f} s" for n, s in imports.items()))


if __name__ == "__main__":
    main()
