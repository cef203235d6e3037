"""Seconds per round: the same job (FedAvg unless --strategy) in Flower simulation and in a real deployment
(SuperLink + SuperNodes as processes on 127.0.0.1), measured side by side, and where the
deployment's time goes.

    python benchmarks/deploy_vs_sim.py [--nodes 3] [--rounds 3] [--strategy fedavg]

Prints a table; nothing is asserted. The breakdown per exchange:
- training + evaluation: the handler's own work, measured in simulation (per-exchange time there);
- ClientApp process start: Flower starts a fresh `flwr-clientapp` process per message, which
  imports torch and florist and loads the node's data (measured by timing that import here);
- the rest: Flower's polling (the SuperNode pulls every 3 s when idle) and its object store:
  every array of a model is a separate object, pulled and pushed one request at a time by the
  SuperNode and by the ClientApp (22 objects each way for the digits CNN).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from florist.common.config import RunConfig
from florist.deploy.federation import LocalFederation, flower_bin
from florist.server.simulation import simulate

# Exchanges per round with evaluation: FedAvg-like strategies train, then evaluate; PeFLL and
# OD-PFL train in three exchanges, then predict in two (descriptor, then model).
EXCHANGES_PER_ROUND = {"pefll": 5, "odpfl": 5}


def median_round(results: dict) -> float:
    """Median seconds of the rounds after the first (the first includes warm-up)."""
    return statistics.median(r["seconds"] for r in results["rounds"][1:])


def clientapp_start_seconds(repeats: int = 3) -> float:
    """What a fresh ClientApp process pays before its handler runs: `flwr-clientapp` start-up
    plus importing florist's client (torch) and loading an embedded partition."""
    code = ("import florist.client.app; from florist.common.data import embedded_client; "
            "embedded_client(0, 3, 'iid', 1, 0.15, 0.2, public_size=200)")  # fmt: skip
    times = []
    for _ in range(repeats):
        start = time.monotonic()
        subprocess.run([flower_bin("flwr-clientapp"), "--help"], capture_output=True, check=True)
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.monotonic() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strategy", default="fedavg")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="florist-bench-"))
    values = {"strategy": args.strategy, "num-server-rounds": args.rounds, "partition": "iid", "min-nodes": args.nodes, "unseen-fraction": 0.0}

    sim = simulate(RunConfig.from_mapping(values | {"results-dir": str(work / "sim")}), args.nodes)
    configs = [{"partition-id": i, "num-partitions": args.nodes, "state-dir": str(work / "state")}
               for i in range(args.nodes)]  # fmt: skip
    with LocalFederation(work / "federation", configs) as fed:
        command = fed.run_command(values | {"results-dir": str(work / "deploy")})
        subprocess.run(command, env=fed.env, check=True, capture_output=True)
    deploy = json.loads((work / "deploy" / "results.json").read_text())

    sim_round, deploy_round = median_round(sim), median_round(deploy)
    start = clientapp_start_seconds()
    exchanges = EXCHANGES_PER_ROUND.get(args.strategy, 2)
    per_exchange, work_share = deploy_round / exchanges, sim_round / exchanges
    same = [c["accuracy"] for c in sim["clients"]] == [c["accuracy"] for c in deploy["clients"]]
    print(f"{args.strategy}, {exchanges} exchanges per round, {args.nodes} nodes, {args.rounds} rounds, iid digits; median of rounds 2..{args.rounds}")
    print(f"{'seconds per round, simulation':<48}{sim_round:8.2f}")
    print(f"{'seconds per round, deployment':<48}{deploy_round:8.2f}   ({deploy_round / sim_round:.0f}x)")
    print(f"{'per exchange in deployment':<48}{per_exchange:8.2f}")
    print(f"{'  training/evaluation (simulation exchange)':<48}{work_share:8.2f}")
    print(f"{'  ClientApp process start + imports + data':<48}{start:8.2f}")
    print(f"{'  Flower polling + object transfers (the rest)':<48}{per_exchange - work_share - start:8.2f}")
    print(f"per-client accuracies identical in both: {same}")


if __name__ == "__main__":
    main()
