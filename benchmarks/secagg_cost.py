"""What secure aggregation costs: bytes per node per stage and seconds for the whole protocol.

    python benchmarks/secagg_cost.py [--nodes 5 20 50] [--size 100000] [--repeat 1]

Runs `florist.common.secagg.simulate` (every node in this one process, one after another) on
random updates, once with every node answering and once with one node leaving after it shared its
keys. Seconds are split by who worked: a node from its request to its reply, the server between
stages; "nodes in parallel" adds each stage's mean node time to the server's, what a round would
take with every node on a machine of its own and no network. Bytes are the payloads a stage moves
(keys, ciphertexts, vectors, shares; 8 per number), without Flower's message framing; the plain
exchange (an update as float32 and its weight) is the baseline. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import defaultdict

import numpy as np

from florist.common import secagg


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
    secagg.simulate(updates, weights, secagg.SecAggSetup.for_nodes(num_nodes), leave=leave, spy=spy)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[5, 20, 50])
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=1, help="runs per setting, the fastest shown")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
