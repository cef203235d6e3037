"""Does the warm executor leak? One SuperNode serves N messages (FedAvg, two per round); the
executor's resident memory (and the SuperNode's) is read after the first round and at the end.

    python benchmarks/executor_memory.py [--messages 200]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from scratch import work_folder

from florist.deploy.federation import LocalFederation


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def executor_pid(supernode_pid: int) -> int:
    children = Path(f"/proc/{supernode_pid}/task/{supernode_pid}/children").read_text().split()
    return next(int(p) for p in children if "florist.deploy.executor" in Path(f"/proc/{p}/cmdline").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200)
    args = parser.parse_args()
    with work_folder("florist-memory-") as work:
        rounds = args.messages // 2
        config = {
            "strategy": "fedavg",
            "num-server-rounds": rounds,
            "min-nodes": 1,
            "partition": "iid",
            "unseen-fraction": 0.0,
            "results-dir": str(work / "out"),
        }
        with LocalFederation(work, [{"partition-id": 0, "num-partitions": 1, "state-dir": str(work / "state")}]) as fed:
            node = fed.nodes[0].pid
            executor = executor_pid(node)
            run = subprocess.Popen(
                fed.run_command(config), env=fed.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            progress = work / "out" / "results.json"
            while not (progress.exists() and json.loads(progress.read_text())["rounds"]):
                time.sleep(0.2)
            before = rss_mb(executor), rss_mb(node)
            start = time.monotonic()
            run.wait()
            after = rss_mb(executor), rss_mb(node)
            served = (fed.logs / "supernode-0.log").read_text().count(": warm process")
        print(f"{served} messages served warm in {time.monotonic() - start:.0f} s after round 1")
        print(f"warm executor RSS: {before[0]:.0f} MB after round 1, {after[0]:.0f} MB after all {served} messages")
        print(f"SuperNode RSS:     {before[1]:.0f} MB after round 1, {after[1]:.0f} MB after all {served} messages")


if __name__ == "__main__":
    main()
