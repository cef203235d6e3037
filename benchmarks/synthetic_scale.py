"""A thousand clients in simulation on one machine: `florist simulate` on FedProx's
Synthetic(1, 1) with 1,000 clients, 5 % of the seen ones sampled per round, for FedAvg, kNN-Per
and PeFLL; prints seconds per round, wall time (the final evaluation of every client included),
and the peak memory of every process the run started (summed RSS and PSS: Ray's workers too).

    python benchmarks/synthetic_scale.py [--clients 1000] [--rounds 5] [--strategies fedavg,knnper,pefll]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from deploy_scale import memory_mb

from florist.common.processes import marked

MARKER = "FLORIST_BENCHMARK"


def run(out: Path, strategy: str, clients: int, rounds: int) -> dict:
    command = [
        sys.executable,
        "-m",
        "florist",
        "simulate",
        "--strategy",
        strategy,
        "--dataset",
        "synthetic:1,1",
        "--num-clients",
        str(clients),
        "--rounds",
        str(rounds),
        "--results-dir",
        str(out),
        "--run-config",
        'model="mlp" fraction-train=0.05 min-train-nodes=1 eval-every=0',
    ]
    token, peak, done = secrets.token_hex(8), [0.0, 0.0], threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            peak[:] = [max(p, m) for p, m in zip(peak, memory_mb(marked(MARKER, token)))]

    threading.Thread(target=sample, daemon=True).start()
    start = time.monotonic()
    finished = subprocess.run(command, capture_output=True, text=True, env=os.environ | {MARKER: token})
    wall = time.monotonic() - start
    done.set()
    if finished.returncode != 0:
        raise SystemExit(f"{strategy}: simulate failed:\n{finished.stderr[-3000:]}")
    results = json.loads((out / "results.json").read_text())
    return {
        "wall": wall,
        "round": statistics.median(r["seconds"] for r in results["rounds"]),
        "rss": peak[0],
        "pss": peak[1],
        "scored": sum(s["num_clients"] for s in results["summary"].values()),
        "seen": results["summary"]["seen"]["mean_accuracy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--strategies", default="fedavg,knnper,pefll")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="florist-synthetic-"))
    print(f"florist simulate, Synthetic(1, 1), {args.clients} clients, fraction-train 0.05, {args.rounds} rounds")
    print(
        f"{'strategy':<9}{'s/round':>9}{'wall s':>8}{'scored':>8}{'seen acc.':>10}"
        f"{'peak RSS MB':>13}{'peak PSS MB':>13}"
    )
    for strategy in args.strategies.split(","):
        r = run(work / strategy, strategy, args.clients, args.rounds)
        print(
            f"{strategy:<9}{r['round']:9.1f}{r['wall']:8.0f}{r['scored']:>8}{100 * r['seen']:10.1f}{r['rss']:13,.0f}"
            f"{r['pss']:13,.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
