"""Seconds per round of FedAvg (LeNet, 20 clients, dirichlet:0.3, 1 local epoch, batch 16):
a plain PyTorch loop with no Flower, florist's in-process runtime and Flower's simulation,
side by side in one run; with --deploy also a local deployment (4 SuperNodes).

    python benchmarks/throughput.py [DATASET] [--rounds 5] [--set KEY=VALUE ...] [--deploy]

DATASET: `mnist5k` (5,000 embedded 28×28 MNIST images) by default, or anything `dataset=` takes
(e.g. a local parquet or image folder). The plain loop does the same training as florist's
clients (same data, initial weights, shuffling seeds, sample-weighted mean) in one thread, so
its time is the compute floor; what a runtime adds over it is its overhead. Rounds are
train-only (`eval-every=0`; the loop evaluates nothing) and figures are medians of rounds
2..N (the first pays start-up costs). Nothing is asserted; the two targets are printed:

* in-process ÷ plain ≤ 1.10: the in-process runtime runs one client at a time, as the loop
  does, so beyond the loop it only adds serialization and florist's handler bookkeeping.
* simulation ÷ (plain ÷ P) ≤ 1.3, P = min(cores, training clients): with C cores and 1 CPU per
  client Ray runs at most C clients at once, so a round can at best take plain ÷ C.

With --deploy, per `train` exchange the slowest node's handler seconds of a 4-node local
deployment is compared with the same 4-client run in-process: the same handler work, so their
ratio is what real processes (and their own data loading) cost a handler, once with every
node training (3 at once here: the cores are shared) and once with one node per round. It also
prints the deployment's overhead per exchange (an exchange's seconds less its slowest node's
handler: polling, transfers, processes; target ≤ 0.15 s) and PeFLL's rounds (several
exchanges each) beside FedAvg's, deployed against in-process (target ≤ 2×), with both runs' accuracy,
and the CPU-seconds per exchange (rounds 2..N) of every process of the federation: on a shared machine the
wall-clock figures are mostly waiting for a core, the CPU is what the deployment costs.
`--deploy-only` skips the 20-client runtimes, for a quick check of one commit.

`--repeat N` runs the plain loop and in-process N times, one after the other, and gives their
ratio as the median of the N pairs: this machine's speed drifts by ±15 % from one minute to the
next, more than a change of a few percent moves a single run. The simulation line also gives
its CPU-seconds a round (Ray's actors, the driver, Ray's own processes) and the shortest round
that CPU allows on P cores: what the simulation target is measured against.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import tomllib
import zlib
from pathlib import Path
from typing import Any

import torch
from scratch import work_folder

from florist.common import scenarios, training
from florist.common.data import unseen_partitions
from florist.common.metrics import summarize
from florist.common.models import seeded_model
from florist.common.processes import descendants
from florist.config import RunConfig
from florist.deploy.federation import LocalFederation
from florist.runners.inprocess import run_in_process
from florist.runners.simulation import client_resources, simulate

CLIENTS, DEPLOY_NODES = 20, 4
# The deployed nodes train at once, in-process one after the other: with more training nodes
# than cores their handlers share the cores, so the second case trains one node per round to
# compare the handlers' own cost.
DEPLOY_CASES = {
    "fedavg, every node trains": {},
    "fedavg, one node trains per round": {"fraction-train": 0.01, "min-train-nodes": 1},
    "pefll, every node trains": {"strategy": "pefll"},
}
ROUND_DONE = re.compile(r"round \d+ done in")  # the ServerApp's line at each round's end, as `flwr run` streams it
TARGET_OVERHEAD, TARGET_PEFLL = 0.15, 2.0  # s per deployed exchange; PeFLL's deployed ÷ in-process round
TARGET_INPROCESS, TARGET_SIMULATION = 1.10, 1.3  # ÷ plain; ÷ (plain ÷ P)


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    """`--set k=v` pairs; a value is read as TOML (numbers, booleans), else kept as a string."""
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set {pair!r}: expected KEY=VALUE")
        try:
            values[key] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            values[key] = text
    return values


def warm(cfg: RunConfig, num_clients: int) -> None:
    """Decode every partition once: a folder dataset's first decode is slow, then cached on disk."""
    for pid in range(num_clients):
        scenarios.client_data(pid, num_clients, cfg)


def weighted_mean(states: list[dict[str, torch.Tensor]], weights: list[int]) -> dict[str, torch.Tensor]:
    """FedAvg's aggregate: the sample-weighted mean of the clients' state dicts."""
    total = float(sum(weights))
    return {
        key: sum(s[key].double() * (w / total) for s, w in zip(states, weights)).to(ref.dtype)
        for key, ref in states[0].items()
    }


def plain_loop(cfg: RunConfig, num_clients: int) -> tuple[list[float], float]:
    """Seconds of each round of the same FedAvg training with plain PyTorch in one thread, and
    the final model's seen mean accuracy (computed after timing), to compare with florist's."""
    held_out = unseen_partitions(num_clients, cfg.unseen_fraction, cfg.seed)
    clients = {pid: scenarios.client_data(pid, num_clients, cfg) for pid in range(num_clients) if pid not in held_out}
    shape = next(iter(clients.values())).input_shape
    global_state = seeded_model(cfg.model, shape, cfg.num_classes, cfg.seed).state_dict()
    threads, seconds = torch.get_num_threads(), []
    torch.set_num_threads(1)  # one client on one core, as a simulated client with 1 CPU
    try:
        for server_round in range(1, cfg.num_server_rounds + 1):
            start = time.perf_counter()
            states, weights = [], []
            for pid, d in clients.items():
                model = seeded_model(cfg.model, shape, cfg.num_classes, cfg.seed)
                model.load_state_dict(global_state)
                generator = training.seeded_generator(cfg.seed, server_round, zlib.crc32(f"partition-{pid}".encode()))
                training.train(
                    model,
                    d.x_train,
                    d.y_train,
                    epochs=cfg.local_epochs,
                    batch_size=cfg.batch_size,
                    lr=cfg.lr,
                    momentum=cfg.momentum,
                    weight_decay=cfg.weight_decay,
                    generator=generator,
                )
                states.append(model.state_dict())
                weights.append(len(d.x_train))
            global_state = weighted_mean(states, weights)
            seconds.append(time.perf_counter() - start)
        model = seeded_model(cfg.model, shape, cfg.num_classes, cfg.seed)
        model.load_state_dict(global_state)
        scores = [training.evaluate(model, d.x_test, d.y_test)[1] for d in clients.values()]
    finally:
        torch.set_num_threads(threads)
    return seconds, summarize(scores, [len(d.x_test) for d in clients.values()])["mean_accuracy"]


def median_later(values: list[float]) -> float:
    """The median of rounds 2..N (all rounds when there is only one)."""
    return statistics.median(values[1:] or values)


def figures(results: dict) -> dict[str, float]:
    """Median seconds per round; per training exchange (`train`, `train.*`) the slowest handler
    and data seconds; and the median overhead of every exchange of rounds 2..N: its seconds less
    its slowest node's handler seconds (what the runtime adds to the work)."""
    rounds = results["rounds"]
    trains = [[e for e in r["exchanges"] if e["type"].partition(".")[0] == "train"] for r in rounds]
    handler = [max((e["handler_seconds_max"] for e in t), default=0.0) for t in trains]
    data = [max((e["data_seconds_max"] for e in t), default=0.0) for t in trains]
    later = [e for r in rounds[1:] or rounds for e in r["exchanges"]]
    return {
        "round": median_later([r["seconds"] for r in rounds]),
        "handler": median_later(handler),
        "data": median_later(data),
        "overhead": statistics.median([e["seconds"] - e["handler_seconds_max"] for e in later] or [0.0]),
        "exchanges": len(later) / max(len(rounds) - 1, 1),
        "accuracy": results["summary"]["seen"]["mean_accuracy"],
        "cpu": results.get("cpu_seconds", 0.0) / max(len(later), 1),
    }


def deploy(work: Path, values: dict[str, Any]) -> dict:
    """The run on a local SuperLink and 4 SuperNodes (florist's warm executor), one torch thread each."""
    configs = [
        {"partition-id": i, "num-partitions": DEPLOY_NODES, "state-dir": str(work / "state"), "torch-threads": 1}
        for i in range(DEPLOY_NODES)
    ]
    with LocalFederation(work / "federation", configs) as fed:
        command = fed.run_command(values | {"results-dir": str(work / "out")})
        done = subprocess.Popen(command, env=fed.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines, cpu = [], []  # the federation's CPU as each round's end is logged
        for line in done.stdout:
            lines.append(line)
            if ROUND_DONE.search(line):
                cpu.append(federation_cpu())
    if done.wait() != 0:
        tail = "".join(lines[-30:])
        raise SystemExit(f"the deployed run failed (status {done.returncode}); logs in {work}:\n{tail}")
    results = json.loads((work / "out" / "results.json").read_text())
    return results | {"cpu_seconds": cpu[-1] - cpu[0] if len(cpu) > 1 else 0.0}


def federation_cpu() -> float:
    """CPU-seconds so far of every process of the local federation (SuperLink, SuperNodes, fork
    server, executors), with the task processes they reaped: what a deployed run costs the
    machine, which a loaded machine's wall-clock figures hide."""
    return sum(seconds for _, seconds in process_cpu(descendants([os.getpid()]), reaped=True))


def process_cpu(pids: list[int], reaped: bool = False) -> list[tuple[str, float]]:
    """(command line, CPU-seconds so far) of each of `pids` still alive; with `reaped`, the
    children it has waited for count as its own."""
    found = []
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue  # gone meanwhile
        ticks = fields[11:15] if reaped else fields[11:13]  # utime, stime (cutime, cstime)
        found.append((command, sum(int(v) for v in ticks) / os.sysconf("SC_CLK_TCK")))
    return found


def simulation_cpu() -> dict[str, float]:
    """CPU-seconds so far of this process (the driver: ServerApp, Flower's engine, Ray's client
    calls), of Ray's actors (the clients) and of Ray's own processes (raylet, GCS, agents)."""
    parts = {"driver": time.process_time(), "actors": 0.0, "ray": 0.0}
    for command, seconds in process_cpu(descendants([os.getpid()])):
        parts["actors" if "ClientAppActor" in command else "ray"] += seconds
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", nargs="?", default="mnist5k", metavar="DATASET")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another run-config key")
    parser.add_argument("--deploy", action="store_true", help="also a 4-node local deployment (takes minutes)")
    parser.add_argument("--deploy-only", action="store_true", help="only the 4-node deployment and its in-process twin")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run the plain loop and in-process N times, alternating, and give each pair's ratio and their median "
        "(a drifting machine moves single runs by ±15%%)",
    )
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    with work_folder("florist-throughput-") as work:
        values = {
            "strategy": "fedavg",
            "dataset": args.dataset,
            "model": "lenet",
            "partition": "dirichlet:0.3",
            "num-server-rounds": args.rounds,
            "min-nodes": CLIENTS,
            "eval-every": 0,
        } | parse_sets(args.set)
        if not args.deploy_only:
            runtimes(values, work, args.repeat)
        if args.deploy or args.deploy_only:
            deployments(values, work)


def runtimes(values: dict[str, Any], work: Path, repeat: int = 1) -> None:
    """The plain loop, in-process and simulation on 20 clients, side by side; the first two
    `repeat` times, alternating."""
    cfg = RunConfig.from_mapping(values)
    cores = len(os.sched_getaffinity(0))
    training_clients = CLIENTS - len(unseen_partitions(CLIENTS, cfg.unseen_fraction, cfg.seed))
    print(
        f"{CLIENTS} clients ({training_clients} train), {cfg.dataset}, {cfg.model}, {cfg.partition}, "
        f"{cfg.local_epochs} epoch(s), batch {cfg.batch_size}, lr {cfg.lr}, {cores} cores; "
        f"medians of rounds 2..{cfg.num_server_rounds}; work folder {work}"
    )
    warm(cfg, CLIENTS)

    ratios = []
    for attempt in range(repeat):
        start = time.process_time()
        plain_seconds, plain_accuracy = plain_loop(cfg, CLIENTS)
        plain_cpu = (time.process_time() - start) / cfg.num_server_rounds  # its one thread, evaluation included
        plain = median_later(plain_seconds)
        inproc = run_in_process(cfg.replace(results_dir=str(work / f"inprocess{attempt}")), CLIENTS, cpus_per_client=1)
        seconds = figures(inproc)["round"]
        ratios.append(seconds / plain)
        if repeat > 1:
            print(f"  pair {attempt + 1}: plain {plain:.3f} s, in-process {seconds:.3f} s: {ratios[-1]:.3f}×")
    cpu: list[dict[str, float]] = []  # as each round of the simulation ends
    sim = simulate(
        cfg.replace(results_dir=str(work / "simulation")),
        CLIENTS,
        on_round=lambda _: cpu.append(simulation_cpu()),
        resources=client_resources(1.0, 0.0),
    )
    stats = {"in-process": figures(inproc), "simulation": figures(sim)}

    print(f"\n  {'runtime':<12}{'s/round':>9}{'× plain':>9}{'train data s':>14}")
    print(f"  {'plain loop':<12}{plain:9.2f}{1.0:8.2f}×{'–':>14}")
    for runtime, s in stats.items():
        print(f"  {runtime:<12}{s['round']:9.2f}{s['round'] / plain:8.2f}×{s['data']:14.3f}")
    parallel = min(cores, training_clients)
    sim_ratio = stats["simulation"]["round"] / (plain / parallel)
    spread = f", the median of {repeat} pairs ({min(ratios):.2f}-{max(ratios):.2f})" if repeat > 1 else ""
    inproc_ratio = statistics.median(ratios)
    print(f"\n  in-process ÷ plain:                 {inproc_ratio:.2f} (target ≤ {TARGET_INPROCESS}){spread}")
    print(f"  simulation ÷ (plain ÷ {parallel} cores):     {sim_ratio:.2f} (target ≤ {TARGET_SIMULATION})")
    if len(cpu) > 2:  # rounds 2..N, as the seconds are
        each = {part: (cpu[-1][part] - cpu[0][part]) / (len(cpu) - 1) for part in cpu[0]}
        floor = sum(each.values()) / parallel
        below = floor / (plain / parallel)
        print(
            f"  simulation's CPU-s a round: clients (Ray's actors) {each['actors']:.2f}, the plain loop "
            f"{plain_cpu:.2f}; driver {each['driver']:.2f}; Ray's own processes {each['ray']:.2f}. "
            f"On {parallel} cores no round takes under {floor:.2f} s: {below:.2f}× plain ÷ {parallel}"
        )
    print(
        f"  final seen mean accuracy: in-process {stats['in-process']['accuracy']:.4f}, plain loop "
        f"{plain_accuracy:.4f}, simulation {stats['simulation']['accuracy']:.4f}"
    )


def deployments(values: dict[str, Any], work: Path) -> None:
    """Each of DEPLOY_CASES on 4 deployed nodes and in-process: handlers, rounds, and the
    deployment's overhead per exchange, then one summary line per case."""
    rows = {}
    for label, extra in DEPLOY_CASES.items():
        values4 = values | {"min-nodes": DEPLOY_NODES} | extra
        cfg4 = RunConfig.from_mapping(values4)
        warm(cfg4, DEPLOY_NODES)
        folder = label.replace(", ", "-").replace(" ", "-")
        local = figures(run_in_process(cfg4.replace(results_dir=str(work / f"inprocess4-{folder}")), DEPLOY_NODES))
        deployed = figures(deploy(work / f"deploy-{folder}", values4))
        rows[label] = (local, deployed)
        print(f"\n{DEPLOY_NODES} nodes, {label}; per training exchange (slowest node)")
        print(f"  {'runtime':<12}{'s/round':>9}{'handler s':>11}{'data s':>9}")
        for runtime, s in (("in-process", local), ("deploy", deployed)):
            print(f"  {runtime:<12}{s['round']:9.2f}{s['handler']:11.3f}{s['data']:9.3f}")
        print(f"  deploy handler ÷ in-process handler: {deployed['handler'] / local['handler']:.2f}")
    print(f"\n{DEPLOY_NODES} nodes deployed against in-process, medians of rounds 2..N")
    print(
        f"  {'case':<36}{'exch/round':>11}{'in-proc s':>10}{'deploy s':>10}{'÷':>7}{'overhead s/exch':>17}"
        f"{'CPU-s/exch':>12}  accuracy"
    )
    for label, (local, deployed) in rows.items():
        same = "same" if deployed["accuracy"] == local["accuracy"] else "DIFFERS"
        print(
            f"  {label:<36}{deployed['exchanges']:11.0f}{local['round']:10.2f}{deployed['round']:10.2f}"
            f"{deployed['round'] / local['round']:6.2f}×{deployed['overhead']:17.3f}{deployed['cpu']:12.2f}  {same} "
            f"({deployed['accuracy']:.4f})"
        )
    print(f"  targets: overhead ≤ {TARGET_OVERHEAD} s per exchange; PeFLL deploy ÷ in-process ≤ {TARGET_PEFLL}×")
    print(
        f"  CPU-s/exch: every federation process's CPU from round 1's end to the last round's, per exchange; "
        f"load average {os.getloadavg()[0]:.1f} at the end"
    )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the work folder is gone by now; Flower's simulation workers may wait on Ray forever
        print("throughput.py: interrupted", file=sys.stderr)
        os._exit(130)
