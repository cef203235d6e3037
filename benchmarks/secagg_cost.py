"""What secure aggregation costs: bytes per node per stage and seconds for the whole protocol.

    python benchmarks/secagg_cost.py [--nodes 5 20 50] [--size 100000] [--repeat 1]
    python benchmarks/secagg_cost.py --federation [--nodes 5 20 50] [--rounds 3] [--partition iid] [--out DIR]

By default it runs `florist.common.secagg_server.simulate` (every node in this one process, one after another) on
random updates, once with every node answering and once with one node leaving after it shared its
keys. Seconds are split by who worked: a node from its request to its reply, the server between
stages; "nodes in parallel" adds each stage's mean node time to the server's, what a round would
take with every node on a machine of its own and no network. Bytes are the payloads a stage moves
(keys, ciphertexts, vectors, shares; 8 per number), without Flower's message framing; the plain
exchange (an update as float32 and its weight) is the baseline. Nothing is asserted.

`--federation` runs real florist federations in process (florist/runners/inprocess.py): FedAvg on
the embedded digits, every node training every round, without and with `secure-aggregation =
"secaggplus"`, one run after the other at each node count (after a short warm-up run). Bytes are
results.json's `bytes_up` / `bytes_down`: every exchange of the round (SecAgg+'s four stages
included) as Flower serializes its records, without gRPC's framing. Evaluation runs only after the
last round, so a round is its training alone. The nodes answer one after another in this one
process, so a round's seconds are the sum of every node's work plus the server's, not what
nodes on machines of their own would take; round 1 is shown apart and left out of the means.
Beside wall seconds (results.json's, and each exchange's), this process's CPU seconds from one
round's end to the next: what other work on the machine does not inflate.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from florist.common import secagg, secagg_server
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process


def size(payload: object) -> int:
    """Bytes a payload moves: bytes and arrays as they are, a number as 8."""
    if isinstance(payload, bytes | np.ndarray):
        return len(payload) if isinstance(payload, bytes) else payload.nbytes
    if isinstance(payload, dict):
        return sum(size(k) + size(v) for k, v in payload.items())
    if isinstance(payload, list | tuple):
        return sum(size(v) for v in payload)
    if dataclasses.is_dataclass(payload):
        return sum(size(getattr(payload, f.name)) for f in dataclasses.fields(payload))
    return 8


@dataclasses.dataclass
class Cost:
    """One round's cost: per stage, mean bytes down and up per node, mean seconds a node and the server
    worked; and the seconds of the whole protocol in this one process."""

    down: dict[str, float]
    up: dict[str, float]
    node_s: dict[str, float]
    server_s: dict[str, float]
    total_s: float
    cpu_s: float

    def parallel_s(self) -> float:
        """A round's seconds were the nodes working side by side: each stage's mean node plus the server."""
        return sum(self.node_s.values()) + sum(self.server_s.values())


def measure(num_nodes: int, length: int, leave: dict[str, set[int]]) -> Cost:
    """Run one round, attributing each spell between two payloads to whoever worked in it: a node
    from its request to its reply, the server from a stage's last reply to the next stage's first request."""
    rng = np.random.default_rng(num_nodes)
    updates = {nid: rng.uniform(-1, 1, length) for nid in range(1, num_nodes + 1)}
    weights = {nid: float(rng.integers(1, 1000)) for nid in updates}
    events: list[tuple[float, str, int, int, int]] = []

    def spy(stage: str, sender: int, recipient: int, payload: object) -> None:
        events.append((time.perf_counter(), stage, sender, recipient, size(payload)))

    start, cpu = time.perf_counter(), time.process_time()
    secagg_server.simulate(updates, weights, secagg.SecAggSetup.for_nodes(num_nodes), leave=leave, spy=spy)
    end, cpu = time.perf_counter(), time.process_time() - cpu
    down, up, node_s, server_s = (defaultdict(list) for _ in range(4))
    asked: dict[int, float] = {}
    for i, (at, stage, sender, recipient, nbytes) in enumerate(events):
        if sender == 0:
            down[stage].append(nbytes)
            asked[recipient] = at
            continue
        up[stage].append(nbytes)
        node_s[stage].append(at - asked[sender])
        following = [e for e in events[i + 1 :] if e[2] == 0]
        if not following or following[0][1] != stage:
            server_s[stage].append((following[0][0] if following else end) - at)
    return Cost(_means(down), _means(up), _means(node_s), {k: sum(v) for k, v in server_s.items()}, end - start, cpu)


def _means(values: dict[str, list[float]]) -> dict[str, float]:
    return {k: float(np.mean(v)) for k, v in values.items()}


def num(value: float) -> str:
    return f"{value:,.0f}"


def table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def fastest(num_nodes: int, length: int, leave: dict[str, set[int]], repeat: int) -> Cost:
    """The run of `repeat` with the least CPU time: the one other work on the machine disturbed least."""
    return min((measure(num_nodes, length, leave) for _ in range(repeat)), key=lambda cost: cost.cpu_s)


def core(args: argparse.Namespace) -> None:
    """The SecAgg+ core alone, on random updates of `--size` values."""
    stages, drop = secagg.STAGES, {"collect masked vectors": {1}}
    costs = {n: (fastest(n, args.size, {}, args.repeat), fastest(n, args.size, drop, args.repeat)) for n in args.nodes}
    print(f"a {args.size:,}-value update; the plain exchange sends {num(args.size * 4 + 8)} bytes up per node\n")
    table(
        ["nodes", *(f"{s}: down / up" for s in stages), "up, all stages"],
        [
            [str(n), *(f"{num(c.down[s])} / {num(c.up[s])}" for s in stages), num(sum(c.up.values()))]
            for n, (c, _) in costs.items()
        ],
    )
    header = ["nodes", "a node's s per stage", "the server's s per stage", "one process: s (CPU s)"]
    header += ["s, nodes in parallel", "one dropped: the server's s to unmask", "one dropped: one process s (CPU s)"]
    table(header, [[str(n), *_seconds(c, d)] for n, (c, d) in costs.items()])


def _seconds(cost: Cost, dropped: Cost) -> list[str]:
    stages = secagg.STAGES
    return [
        " / ".join(f"{cost.node_s[s]:.2f}" for s in stages),
        " / ".join(f"{cost.server_s[s]:.2f}" for s in stages),
        f"{cost.total_s:.1f} ({cost.cpu_s:.1f})",
        f"{cost.parallel_s():.2f}",
        f"{dropped.server_s[stages[3]]:.2f}",
        f"{dropped.total_s:.1f} ({dropped.cpu_s:.1f})",
    ]


MODES = {"plain": "none", "secure": "secaggplus"}


@dataclasses.dataclass
class Federated:
    """One in-process run's figures per round: bytes as results.json counts them (every exchange
    of the round, as serialized by Flower), seconds as the mean over the timed rounds, split by
    exchange and into what the server did between exchanges."""

    up: float
    down: float
    seconds: float
    cpu_s: float
    first_s: float
    exchange_s: dict[str, float]
    server_s: float
    accuracy: float | None


def federate(num_nodes: int, mode: str, args: argparse.Namespace) -> Federated:
    """FedAvg on the embedded digits, every node training every round, evaluated only at the end
    (so a round's bytes and seconds are its training alone)."""
    values = {
        "strategy": "fedavg",
        "num-server-rounds": args.rounds,
        "partition": args.partition,
        "seed": args.seed,
        "unseen-fraction": 0.0,
        "min-nodes": num_nodes,
        "min-train-nodes": num_nodes,
        "eval-every": 0,
        "keep-models": 0,
        "secure-aggregation": MODES[mode],
        "results-dir": str(args.out / f"{num_nodes}-{mode}"),
    }
    cpu: list[float] = []  # this process's CPU seconds as each round ends (after its checkpoint)
    try:
        results = run_in_process(
            RunConfig.from_mapping(values), num_nodes, on_round=lambda _: cpu.append(time.process_time())
        )
    except Exception as err:  # a setting the run refuses, a partition too small: one line
        raise SystemExit(f"{num_nodes} nodes, {mode}: {type(err).__name__}: {str(err).splitlines()[0]}") from None
    rows = results["rounds"]
    timed = rows[1:]
    exchanges: dict[str, list[float]] = defaultdict(list)
    for row in timed:
        for exchange in row["exchanges"]:
            exchanges[exchange["type"]].append(exchange["seconds"])
    server = [row["seconds"] - sum(e["seconds"] for e in row["exchanges"]) for row in timed]
    return Federated(
        float(np.mean([r["bytes_up"] for r in rows])),
        float(np.mean([r["bytes_down"] for r in rows])),
        float(np.mean([r["seconds"] for r in timed])),
        float(np.mean(np.diff(cpu))),
        rows[0]["seconds"],
        _means(exchanges),
        float(np.mean(server)),
        results["summary"]["seen"]["mean_accuracy"],
    )


def federation(args: argparse.Namespace) -> None:
    """Plain and secure runs side by side at each node count, one run at a time."""
    logging.getLogger("flwr").setLevel(logging.WARNING)  # each round's line; a node left out still shows
    federate(2, "plain", argparse.Namespace(**vars(args) | {"rounds": 2, "out": args.out / "warm-up"}))
    runs: dict[int, dict[str, Federated]] = {}
    for n in args.nodes:
        for mode in MODES:
            start = time.perf_counter()
            runs.setdefault(n, {})[mode] = federate(n, mode, args)
            print(f"{n} nodes, {mode}: {time.perf_counter() - start:.0f} s", flush=True)
    print(f"\nFedAvg on digits ({args.partition}), {args.rounds} rounds; bytes: mean per round;", end=" ")
    print("seconds: mean over rounds 2 on, wall (this process's CPU)\n")
    table(
        ["nodes", "plain: up / down", "secure: up / down", "per node, plain: up / down"]
        + ["per node, secure: up / down", "secure ÷ plain: up / down"],
        [[str(n), *_traffic(r["plain"], r["secure"], n)] for n, r in runs.items()],
    )
    table(
        ["nodes", "plain: s (CPU s)", "secure: s (CPU s)", "secure ÷ plain: s (CPU s)", "round 1: plain / secure s"]
        + ["secure: s per exchange", "secure: the server between exchanges, s", "accuracy: plain / secure"],
        [[str(n), *_timing(r["plain"], r["secure"])] for n, r in runs.items()],
    )


def _traffic(plain: Federated, secure: Federated, num_nodes: int) -> list[str]:
    return [
        f"{num(plain.up)} / {num(plain.down)}",
        f"{num(secure.up)} / {num(secure.down)}",
        f"{num(plain.up / num_nodes)} / {num(plain.down / num_nodes)}",
        f"{num(secure.up / num_nodes)} / {num(secure.down / num_nodes)}",
        f"{secure.up / plain.up:.2f} / {secure.down / plain.down:.2f}",
    ]


def _timing(plain: Federated, secure: Federated) -> list[str]:
    def accuracy(run: Federated) -> str:
        return "-" if run.accuracy is None else f"{run.accuracy:.3f}"

    return [
        f"{plain.seconds:.2f} ({plain.cpu_s:.2f})",
        f"{secure.seconds:.2f} ({secure.cpu_s:.2f})",
        f"{secure.seconds / plain.seconds:.1f} ({secure.cpu_s / plain.cpu_s:.1f})",
        f"{plain.first_s:.2f} / {secure.first_s:.2f}",
        ", ".join(f"{kind} {s:.2f}" for kind, s in secure.exchange_s.items()),
        f"{secure.server_s:.2f}",
        f"{accuracy(plain)} / {accuracy(secure)}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[5, 20, 50])
    parser.add_argument("--size", type=int, default=100_000, help="the core's update length")
    parser.add_argument("--repeat", type=int, default=1, help="the core's runs per setting, the fastest shown")
    parser.add_argument("--federation", action="store_true", help="in-process FedAvg runs, plain and secure")
    parser.add_argument("--rounds", type=int, default=3, help="--federation's rounds per run")
    parser.add_argument("--seed", type=int, default=1, help="--federation's seed")
    parser.add_argument("--partition", default="iid", help="--federation's (dirichlet:0.3 cannot split digits 50 ways)")
    parser.add_argument("--out", type=Path, help="--federation's results folders (default: a new temporary one)")
    args = parser.parse_args()
    if args.federation and args.rounds < 2:
        parser.error("--federation needs --rounds 2 or more: round 1 (warming up) is left out of the seconds")
    if args.federation:
        args.out = args.out or Path(tempfile.mkdtemp(prefix="florist-secagg-cost-"))
        federation(args)
    else:
        core(args)


if __name__ == "__main__":
    main()
