"""Many SuperNodes on one machine: `florist deploy-local` with N nodes (20 by default) runs
FedAvg and PeFLL to completion; prints seconds per round, the peak memory of all the processes
the run started (summed RSS, and summed PSS, which counts pages shared between the warm
executors and their forked children once), and whether anything was left running.

    python benchmarks/deploy_scale.py [--nodes 20] [--fedavg-rounds 3] [--pefll-rounds 2] [--executor warm]

(0 rounds leaves a strategy out.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from scratch import work_folder

from florist.common.processes import marked


def memory_mb(pids: list[int]) -> tuple[float, float]:
    """(summed RSS, summed PSS) in MB."""
    rss = pss = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except OSError:
            continue
    return rss / 1024, pss / 1024


def run(out: Path, strategy: str, rounds: int, nodes: int, executor: str) -> dict:
    command = [
        sys.executable,
        "-m",
        "florist",
        "deploy-local",
        "--strategy",
        strategy,
        "--num-nodes",
        str(nodes),
        "--rounds",
        str(rounds),
        "--results-dir",
        str(out),
        "--executor",
        executor,
    ]
    flwr_home = out.resolve() / "federation" / "flwr-home"
    peak, done = [0.0, 0.0], threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            peak[:] = [max(p, m) for p, m in zip(peak, memory_mb(marked("FLWR_HOME", str(flwr_home))))]

    threading.Thread(target=sample, daemon=True).start()
    start = time.monotonic()
    finished = subprocess.run(command, capture_output=True, text=True)
    wall = time.monotonic() - start
    done.set()
    time.sleep(1)
    if finished.returncode != 0:
        raise SystemExit(f"{strategy}: deploy-local failed:\n{finished.stderr[-3000:]}")
    results = json.loads((out / "results.json").read_text())
    return {
        "wall": wall,
        "round": statistics.median(r["seconds"] for r in results["rounds"]),
        "rss": peak[0],
        "pss": peak[1],
        "scored": sum(s["num_clients"] for s in results["summary"].values()),
        "left": len(marked("FLWR_HOME", str(flwr_home))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--fedavg-rounds", type=int, default=3)
    parser.add_argument("--pefll-rounds", type=int, default=2)
    parser.add_argument("--executor", default="warm", choices=("warm", "flower"))
    args = parser.parse_args()
    with work_folder("florist-scale-") as work:
        print(f"florist deploy-local, {args.nodes} SuperNodes, executor {args.executor}, default run config")
        print(
            f"{'strategy':<9}{'rounds':>7}{'s/round':>9}{'wall s':>8}{'scored':>8}{'peak RSS MB':>13}"
            f"{'peak PSS MB':>13}{'left':>6}"
        )
        for strategy, rounds in (("fedavg", args.fedavg_rounds), ("pefll", args.pefll_rounds)):
            if rounds < 1:  # --pefll-rounds 0: FedAvg only
                continue
            r = run(work / strategy, strategy, rounds, args.nodes, args.executor)
            print(
                f"{strategy:<9}{rounds:>7}{r['round']:9.1f}{r['wall']:8.0f}{r['scored']:>8}{r['rss']:13,.0f}{r['pss']:13,.0f}"
                f"{r['left']:>6}"
            )


if __name__ == "__main__":
    main()
