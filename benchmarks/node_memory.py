"""What holding its data costs a node: resident memory of a fresh process that has imported
florist's ClientApp (torch, flwr, florist), then after it loaded one client's whole dataset
(`num-partitions` 1) as a node's handler does, each in a process of its own.

    python benchmarks/node_memory.py DATASET [--runs 2]

DATASET: `mnist5k` or a local parquet / image folder. The first run of a new dataset decodes it
(and, where florist caches decoded data, fills the cache); later runs show what every later
message costs. Prints RSS before the data, peak RSS after it, and their ratio. Run it against
another checkout with PYTHONPATH=that/checkout to compare versions: it uses only
`florist.common.scenarios.client_data` and `RunConfig`, which both have.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CHILD = """
import json, resource, sys, time
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
import florist.apps.registry  # noqa: F401  (hands the run config its strategies)
import florist.apps.client  # noqa: F401  (what every node process holds before its data)
from florist.common import scenarios
from florist.config import RunConfig
before = rss()
start = time.perf_counter()
cfg = RunConfig.from_mapping({"dataset": sys.argv[1], "partition": "iid", "min-nodes": 1})
data = scenarios.client_data(0, 1, cfg)
touched = sum(float(a.sum()) for a in (data.x_train, data.x_val, data.x_test))  # every sample read once
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"before": before, "peak": peak, "after": rss(), "seconds": seconds,
                  "samples": len(data.x_train) + len(data.x_val) + len(data.x_test), "dtype": str(data.x_train.dtype)}))
"""


def measure(dataset: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, dataset], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    mb = 1 << 20
    print(
        f"{'run':>4} {'samples':>8} {'dtype':>8} {'RSS before MB':>14} {'peak MB':>8} {'peak/before':>12} {'load s':>7}"
    )
    for run in range(1, args.runs + 1):
        start = time.perf_counter()
        m = measure(args.dataset)
        print(
            f"{run:>4} {m['samples']:>8} {m['dtype']:>8} {m['before'] / mb:14.0f} {m['peak'] / mb:8.0f} "
            f"{m['peak'] / m['before']:12.2f} {m['seconds']:7.2f}   ({time.perf_counter() - start:.1f} s with imports)"
        )


if __name__ == "__main__":
    main()
