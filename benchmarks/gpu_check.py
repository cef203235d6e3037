"""FedAvg, kNN-Per and PeFLL on a GPU against the CPU at the same seed: per-client accuracy
(mean over seen clients, which must agree within 2 points) and seconds per round, in Flower's
simulation and on a local deployment, side by side in one run.

    python benchmarks/gpu_check.py [--device cuda] [--rounds 5] [--dataset mnist5k]

On a machine without the device it says so and exits 0 (CI has no GPU); `--device cpu` runs
the same comparison CPU against CPU, a check of the script itself. LeNet, 8 clients,
`dirichlet:0.3`; simulation gives each client 1 CPU and, on the GPU, 1/8 of it; the 4-node
deployment gives each node `device` in its node config.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

from scratch import work_folder

from florist.common import devices
from florist.config import RunConfig
from florist.deploy.federation import LocalFederation
from florist.runners.simulation import client_resources, simulate

STRATEGIES = ("fedavg", "knnper", "pefll")
CLIENTS, NODES = 8, 4


def seconds_per_round(results: dict) -> float:
    rounds = [r["seconds"] for r in results["rounds"]]
    return statistics.median(rounds[1:] or rounds)


def seen_accuracy(results: dict) -> float:
    return 100 * results["summary"]["seen"]["mean_accuracy"]


def deploy(work: Path, values: dict, device: str) -> dict:
    configs = [
        {"partition-id": i, "num-partitions": NODES, "state-dir": str(work / "state"), "device": device}
        for i in range(NODES)
    ]
    with LocalFederation(work / "federation", configs) as fed:
        done = subprocess.run(
            fed.run_command(values | {"results-dir": str(work / "out")}), env=fed.env, capture_output=True, text=True
        )
    if done.returncode != 0:
        raise SystemExit(f"the deployed run failed; logs in {work}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads((work / "out" / "results.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dataset", default="mnist5k")
    args = parser.parse_args()
    try:
        devices.resolve(args.device)
    except ValueError as err:
        print(f"gpu_check: nothing to check: {err}")
        return
    with work_folder("florist-gpu-check-") as work:
        gpu_share = 0.0 if args.device == "cpu" else 1 / CLIENTS
        print(
            f"{args.dataset}, LeNet, dirichlet:0.3, {args.rounds} rounds; cpu against {args.device}; work folder {work}"
        )
        print(
            f"  {'strategy':<9}{'runtime':<12}{'cpu acc %':>10}{'dev acc %':>10}{'Δ':>6}"
            f"{'cpu s/rd':>10}{'dev s/rd':>10}"
        )
        worst = 0.0
        for strategy in STRATEGIES:
            base = {
                "strategy": strategy,
                "dataset": args.dataset,
                "model": "lenet",
                "partition": "dirichlet:0.3",
                "num-server-rounds": args.rounds,
                "seed": 1,
            }
            for runtime in ("simulation", "deploy"):
                runs = {}
                for label, device in (("cpu", "cpu"), ("dev", args.device)):
                    values = base | {"device": device, "server-device": device}
                    folder = work / strategy / runtime / label
                    if runtime == "simulation":
                        cfg = RunConfig.from_mapping(values | {"min-nodes": CLIENTS, "results-dir": str(folder)})
                        gpus = gpu_share if label == "dev" else 0.0
                        runs[label] = simulate(cfg, CLIENTS, resources=client_resources(1.0, gpus))
                    else:
                        runs[label] = deploy(folder, values | {"min-nodes": NODES}, device)
                cpu, dev = runs["cpu"], runs["dev"]
                delta = seen_accuracy(dev) - seen_accuracy(cpu)
                worst = max(worst, abs(delta))
                print(
                    f"  {strategy:<9}{runtime:<12}{seen_accuracy(cpu):10.1f}{seen_accuracy(dev):10.1f}{delta:6.1f}"
                    f"{seconds_per_round(cpu):10.2f}{seconds_per_round(dev):10.2f}"
                )
        print(f"largest accuracy difference: {worst:.1f} points ({'within' if worst <= 2 else 'OUTSIDE'} 2 points)")


if __name__ == "__main__":
    main()
