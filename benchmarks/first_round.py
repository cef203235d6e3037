"""Time to the first round and to the end of a short `florist simulate`, in Flower's simulation
runtime (Ray) and in-process, side by side in one run, through the command a user types.

    python benchmarks/first_round.py [--clients 6] [--rounds 3] [--strategy fedavg] [--repeats 1]

Each run is a fresh `florist simulate` process, so both pay Python's and torch's imports. The
first-round time is when the run's checkpoint appears (it is written as round 1 ends), the
total the wall clock. It also says whether the two runtimes gave every client the same accuracy.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from florist.server.checkpoint import FILE as CHECKPOINT


def one(runtime: str, args: argparse.Namespace, out: Path) -> tuple[float, float, dict]:
    command = [sys.executable, "-m", "florist", "simulate", "--strategy", args.strategy]
    command += ["--num-clients", str(args.clients), "--rounds", str(args.rounds)]
    command += ["--runtime", runtime, "--results-dir", str(out)]
    start, first = time.monotonic(), None
    with subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True) as proc:
        while proc.poll() is None:  # the checkpoint is written when round 1 ends
            if first is None and (out / CHECKPOINT).exists():
                first = time.monotonic() - start
            time.sleep(0.05)
        err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"{runtime}: florist simulate failed:\n{err[-2000:]}")
    results = json.loads((out / "results.json").read_text())
    return first if first is not None else float("nan"), time.monotonic() - start, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strategy", default="fedavg")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    accuracies = {}
    print(f"{args.strategy}, {args.clients} clients, {args.rounds} rounds; seconds from the command's start")
    print("| runtime | to round 1 | whole run |\n|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for runtime in ("simulation", "in-process"):
                first, total, results = one(runtime, args, Path(tmp) / f"{runtime}{repeat}")
                accuracies[runtime] = {c["client"]: c["accuracy"] for c in results["clients"]}
                print(f"| {runtime} | {first:.1f} | {total:.1f} |", flush=True)
    same = accuracies["simulation"] == accuracies["in-process"]
    print(f"every client's accuracy identical in both runtimes: {same}")


if __name__ == "__main__":
    main()
