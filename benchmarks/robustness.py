"""FedAvg on the embedded digits with one malicious node, under each aggregation rule: the final
seen accuracy, and its distance in points from the all-honest run with the plain mean; then each
rule's aggregation time per round, measured side by side on the same models.

    python benchmarks/robustness.py [--rounds 15] [--clients 5] [--seed 1] [--partition iid] \
        [--clip-norm 2.0] [--max-node-examples 250] [--timing-nodes 5 20 50] [--threads N] [--out DIR]

In-process federations (florist/runners/inprocess.py); a client mod (`client_mods.attack`, the
one tests/test_adversarial.py uses) makes partition 0 malicious: `scale` sends θ_g + 1000·Δ (Δ its
honest update from the θ_g it received), `flip` θ_g − Δ, `claim` flips and claims 10¹² examples
in its replies, `claim-info` also reports 10¹² training examples at discovery. The clip-norm
and the cap default to what suits this setting: honest updates lie 0.3-2 from the global
model, honest nodes hold about 208 training examples.
Timings: the honest run's last-round models (more nodes: the same models with small noise),
the best of --repeats passes in which the rules take turns. 2-5 minutes on 2 cores at the defaults.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from florist.client.app import build_client_app
from florist.common import protocol
from florist.common.client_mods import ATTACKS, attack
from florist.common.devices import usable_cores
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.server.aggregation import Aggregator

RULES = ("mean", "mean+clip", "mean+cap", "median", "trimmed:0.2", "krum:1", "multikrum:1")


def capturing(captured: dict):
    """A client mod: every node's last trained model, and the model it received, kept in
    `captured` (for the timings)."""

    def mod(msg, context, call_next):
        reply = call_next(msg, context)
        if msg.metadata.message_type == "train" and reply.has_content():
            captured["global"] = msg.content.array_records[protocol.ARRAYS].to_torch_state_dict()
            captured[context.node_id] = reply.content.array_records[protocol.ARRAYS].to_torch_state_dict()
        return reply

    return mod


def settings_of(rule: str, args: argparse.Namespace) -> dict:
    """The run-config keys of a table column."""
    if rule == "mean+clip":
        return {"aggregation": "mean", "clip-norm": args.clip_norm}
    if rule == "mean+cap":
        return {"aggregation": "mean", "max-node-examples": args.max_node_examples}
    return {"aggregation": rule}


def run(name: str, rule: str, args: argparse.Namespace, out: Path, captured: dict | None = None) -> dict:
    values = {
        "num-server-rounds": args.rounds,
        "partition": args.partition,
        "unseen-fraction": 0.0,
        "min-nodes": args.clients,
        "eval-every": 0,
        "seed": args.seed,
        "results-dir": str(out / f"{name}-{rule}"),
    }
    cfg = RunConfig.from_mapping(values | settings_of(rule, args))
    mods = [attack(name, partition_id=0)] + ([capturing(captured)] if captured is not None else [])
    return run_in_process(cfg, args.clients, client_app=build_client_app(mods))


def accuracy_table(args: argparse.Namespace, out: Path, captured: dict) -> list[str]:
    """Rows attack × columns rule: "accuracy (Δ vs honest mean)"; failures of honest nodes marked."""
    honest = None
    lines = [
        f"| attack \\ rule | {' | '.join(RULES)} |",
        "|---|" + "---:|" * len(RULES),
    ]
    for name in args.attacks:
        cells = []
        for rule in RULES:
            results = run(name, rule, args, out, captured if (name, rule) == ("none", "mean") else None)
            accuracy = 100 * results["summary"]["seen"]["mean_accuracy"]
            honest = accuracy if honest is None else honest
            blamed = {f["node_id"] for f in results["failures"]} - {100}
            cells.append(f"{accuracy:.1f} ({accuracy - honest:+.1f})" + (f" ⚠{len(blamed)}" if blamed else ""))
        lines.append(f"| {name} | {' | '.join(cells)} |")
        print(lines[-1], flush=True)
    return lines


def timing_table(args: argparse.Namespace, captured: dict) -> list[str]:
    """Each rule's time for one round's aggregation, at each node count, on the same models:
    the rules take turns (one call each per pass, after one pass to warm up), so a busy
    machine slows them alike; the best pass counts."""
    torch.set_num_threads(args.threads)  # the server's, not a simulated client's one
    reference = captured.pop("global")
    models = [captured[node] for node in sorted(captured)]
    gen = torch.Generator().manual_seed(0)
    header = " | ".join(f"{n} nodes (ms)" for n in args.timing_nodes)
    lines = [f"| rule | {header} |", "|---|" + "---:|" * len(args.timing_nodes)]
    cells: dict[str, list[str]] = {rule: [] for rule in RULES}
    for n in args.timing_nodes:
        states = [
            {k: v + 1e-3 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v for k, v in s.items()}
            for s in (models[i % len(models)] for i in range(n))
        ]
        weights = [208.0] * n
        aggregators = {}
        for rule in RULES:
            settings = settings_of(rule, args)
            aggregators[rule] = Aggregator(settings["aggregation"], settings.get("clip-norm", 0.0))
        best = dict.fromkeys(RULES, float("inf"))
        for attempt in range(args.repeats + 1):
            for rule, aggregator in aggregators.items():
                start = time.perf_counter()
                aggregator(states, weights, reference)
                if attempt:  # the first pass warms up
                    best[rule] = min(best[rule], time.perf_counter() - start)
        for rule in RULES:
            cells[rule].append(f"{1000 * best[rule]:.1f}")
    lines += [f"| {rule} | {' | '.join(cells[rule])} |" for rule in RULES]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--partition", default="iid")
    parser.add_argument("--clip-norm", type=float, default=2.0)
    parser.add_argument("--max-node-examples", type=int, default=250)
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS))
    parser.add_argument("--timing-nodes", nargs="+", type=int, default=[5, 20, 50])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=usable_cores(), help="torch threads for the timings")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.attacks = ["none"] + [a for a in args.attacks if a != "none"]  # the honest reference first
    out = Path(args.out or tempfile.mkdtemp(prefix="florist-robustness-"))
    captured: dict = {}
    table = accuracy_table(args, out, captured)
    timings = timing_table(args, captured)
    print(
        f"\nFedAvg, digits ({args.partition}), {args.clients} nodes of which partition 0 is malicious, "
        f"{args.rounds} rounds, seed {args.seed}; final seen accuracy % (points vs the honest mean run); "
        f"mean+clip: clip-norm {args.clip_norm:g}, mean+cap: max-node-examples {args.max_node_examples}; "
        "⚠N: N honest nodes recorded as failures\n"
    )
    print("\n".join(table))
    print(f"\nAggregation time per round (best of {args.repeats}, {torch.get_num_threads()} torch threads):\n")
    print("\n".join(timings))


if __name__ == "__main__":
    main()
