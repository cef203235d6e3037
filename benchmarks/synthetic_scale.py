"""Many clients on one machine: `florist simulate` on FedProx's Synthetic(1, 1), by default 1,000
clients in Flower's simulation runtime with 5 % of the seen ones trained per round, for FedAvg,
kNN-Per and PeFLL. Prints seconds per round and per client trained in it (a round should cost
what its trained clients cost, not grow with the clients that exist), wall time (discovery and
the final evaluation of every client included), the run process's own peak RSS (`wait4`, exact)
and the peak of every process the run started (summed RSS and PSS, sampled: Ray's workers too).
Issue 55's in-process target, 10,000 clients under 2 GB:

    python benchmarks/synthetic_scale.py [--clients 1000] [--rounds 5] [--fraction 0.05]
        [--runtime simulation|in-process] [--strategies fedavg,knnper,pefll]
    python benchmarks/synthetic_scale.py --runtime in-process --clients 10000 --rounds 3 \
        --fraction 0.01 --strategies fedavg

Measured in-process on 2 cores beside other work (load 4-6), FedAvg, 3 rounds, 1 %: 1,000 clients,
8 trained a round, 0.42 s a round, 53 ms per trained client, peak RSS 1,154 MB; 10,000 clients, 80
trained, 4.01 s a round, 50 ms per trained client, peak RSS 1,583 MB (wall 445 s, most of it
discovery and the final evaluation of every client). A round follows the clients it trains; the
peak grew about 48 kB per client that exists, at discovery and the final evaluation, not per round.
Since a Grid in the server's process gets its messages 1,000 at a time (`exchange.LOCAL_CHUNK`),
side by side at load 10-19: 1,000 clients 975 MB before, 1,009 after; 10,000 clients 1,401 MB
before, 1,029 after (~2 kB per client that exists), accuracies identical.
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
from scratch import work_folder

from florist.common.processes import marked

MARKER = "FLORIST_BENCHMARK"
TARGET_MB = 2000  # issue 55: 10,000 in-process clients under 2 GB


def command(out: Path, strategy: str, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        "-m",
        "florist",
        "simulate",
        "--runtime",
        args.runtime,
        "--strategy",
        strategy,
        "--dataset",
        "synthetic:1,1",
        "--num-clients",
        str(args.clients),
        "--rounds",
        str(args.rounds),
        "--results-dir",
        str(out),
        "--run-config",
        f'model="mlp" fraction-train={args.fraction} min-train-nodes=1 eval-every=0',
    ]


def run(out: Path, strategy: str, args: argparse.Namespace) -> dict:
    """One run's figures; its own peak RSS from `wait4`, which reports exactly that child's."""
    token, peak, done = secrets.token_hex(8), [0.0, 0.0], threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            peak[:] = [max(p, m) for p, m in zip(peak, memory_mb(marked(MARKER, token)))]

    threading.Thread(target=sample, daemon=True).start()
    start = time.monotonic()
    with tempfile.TemporaryFile() as log:
        child = subprocess.Popen(command(out, strategy, args), stdout=log, stderr=log, env=os.environ | {MARKER: token})
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - start
        done.set()
        if child.returncode != 0:
            log.seek(0)
            raise SystemExit(f"{strategy}: simulate failed:\n{log.read().decode(errors='replace')[-3000:]}")
    results = json.loads((out / "results.json").read_text())
    trained = [sum(e["nodes"] for e in r["exchanges"] if e["type"].startswith("train")) for r in results["rounds"]]
    return {
        "wall": wall,
        "round": statistics.median(r["seconds"] for r in results["rounds"]),
        "per_trained": statistics.median(r["seconds"] / max(t, 1) for r, t in zip(results["rounds"], trained)),
        "trained": statistics.median(trained),
        "max_rss": usage.ru_maxrss / 1024,  # kB on Linux
        "rss": peak[0],
        "pss": peak[1],
        "scored": sum(s["num_clients"] for s in results["summary"].values()),
        "seen": results["summary"]["seen"]["mean_accuracy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fraction", type=float, default=0.05, help="fraction-train: of the seen clients, per round")
    parser.add_argument("--runtime", choices=("simulation", "in-process"), default="simulation")
    parser.add_argument("--strategies", default="fedavg,knnper,pefll")
    args = parser.parse_args()
    with work_folder("florist-synthetic-") as work:
        print(
            f"florist simulate --runtime {args.runtime}, Synthetic(1, 1), {args.clients} clients, "
            f"fraction-train {args.fraction}, {args.rounds} rounds"
        )
        print(
            f"{'strategy':<9}{'trained':>8}{'s/round':>9}{'ms/trained':>11}{'wall s':>8}{'scored':>8}{'seen acc.':>10}"
            f"{'peak RSS MB':>13}{'all RSS MB':>12}{'all PSS MB':>12}"
        )
        for strategy in args.strategies.split(","):
            r = run(work / strategy, strategy, args)
            print(
                f"{strategy:<9}{r['trained']:8.0f}{r['round']:9.2f}{1000 * r['per_trained']:11.1f}{r['wall']:8.0f}"
                f"{r['scored']:>8}{100 * r['seen']:10.1f}{r['max_rss']:13,.0f}{r['rss']:12,.0f}{r['pss']:12,.0f}"
                f"  {'under' if r['max_rss'] < TARGET_MB else 'OVER'} {TARGET_MB:,} MB",
                flush=True,
            )


if __name__ == "__main__":
    main()
