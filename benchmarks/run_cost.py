"""What one `flwr run` costs on a local federation that is already up: wall seconds and the
machine's CPU-seconds (from /proc/stat: every process counts, `flwr run`'s own CLI included)
for short FedAvg runs submitted one after the other, then what the idle federation burns.

    python benchmarks/run_cost.py [--nodes 3] [--runs 4] [--rounds 1]
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

from scratch import work_folder

from florist.deploy.federation import LocalFederation


def busy_seconds() -> float:
    """CPU-seconds this machine has spent on anything but idling, since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / 100.0  # USER_HZ; idle and iowait left out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    with work_folder("florist-run-cost-") as work:
        configs = [
            {"partition-id": i, "num-partitions": args.nodes, "state-dir": str(work / "state")}
            for i in range(args.nodes)
        ]
        with LocalFederation(work, configs) as fed:
            time.sleep(5)  # the nodes' first polls settle
            for i in range(args.runs):
                config = {
                    "strategy": "fedavg",
                    "partition": "iid",
                    "unseen-fraction": 0.0,
                    "min-nodes": args.nodes,
                    "num-server-rounds": args.rounds,
                    "results-dir": str(work / f"run{i}"),
                }
                cpu, start = busy_seconds(), time.monotonic()
                done = subprocess.run(fed.run_command(config), env=fed.env, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"run {i} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
                print(f"run {i}: {time.monotonic() - start:.1f} s wall, {busy_seconds() - cpu:.1f} CPU-s", flush=True)
            cpu = busy_seconds()
            time.sleep(10)
            print(f"idle federation: {(busy_seconds() - cpu) / 10:.2f} CPU-s per second")


if __name__ == "__main__":
    main()
