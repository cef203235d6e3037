"""FedAvg on the embedded digits with one or two malicious nodes, under each aggregation rule: the
final seen accuracy, and its distance in points from the all-honest run with the same rule; then
each rule's aggregation time per round, measured side by side on the same models.

    python benchmarks/robustness.py [--rounds 15] [--clients 5] [--seed 1] [--partition iid] \
        [--dataset digits] [--attacks scale noop ...] [--rules median krum:1 ...] [--clip-norm 2.0] \
        [--max-node-examples 250] [--timing-nodes 5 20 50] [--threads N] [--out DIR]

In-process federations (florist/runners/inprocess.py); a client mod (`client_mods.attack`, the
one tests/test_adversarial.py uses) makes partition 0 (and 1) malicious: `scale` sends
θ_g + 1000·Δ (Δ its honest update from the θ_g it received), `flip` θ_g − Δ, `claim` flips and
claims 10¹² examples in its replies, `claim-info` also reports 10¹² training examples at
discovery; `colluders`: partition 0 scales and partition 1 sends NaN (refused, so the rule sees
four replies); `noop` returns θ_g unchanged (`noop2`: partitions 0 and 1 both), `stall` does
that and claims 10¹² examples at discovery and in its replies; `squat` reports partition-3's
node key at discovery (both claimers are then left out of it: partition-3's ⚠ is by design);
`standardizer` runs PeFLL with `hn-standardize` (the `pefll-cifar10` preset's setting), partition 0,
first in key order, describing itself by [1e-10, 0, …]. `--attacks` and `--rules` choose
rows and columns (the honest row always runs: it is the reference). The clip-norm and the cap
default to what suits this setting: honest updates lie 0.3-2 from the global model, honest
nodes hold about 208 training examples.
Timings: the honest run's last-round models (more nodes: the same models with small noise),
the best of --repeats passes in which the rules take turns. About 10 s a run on 2 cores.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from florist.apps.client import build_client_app
from florist.common import protocol
from florist.common.client_mods import ATTACKS, ROLES, attack
from florist.common.devices import usable_cores
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.server.aggregation import Aggregator

RULES = ("mean", "mean+clip", "mean+cap", "median", "trimmed:0.2", "krum:1", "multikrum:1")
# Attacks on another strategy than FedAvg: its run-config keys (its honest reference runs with them too).
STRATEGY_OF = {"standardizer": {"strategy": "pefll", "hn-standardize": True}}
FIRST_NODE = 100  # partition 0's node id in the in-process grid


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


def run(
    name: str,
    rule: str,
    args: argparse.Namespace,
    out: Path,
    captured: dict | None = None,
    strategy: dict | None = None,
) -> dict:
    """One in-process run of `attack` `name` under `rule` (`strategy`: run-config keys of another strategy)."""
    strategy = strategy or {}
    values = {
        "num-server-rounds": args.rounds,
        "dataset": args.dataset,
        "partition": args.partition,
        "unseen-fraction": 0.0,
        "min-nodes": args.clients,
        "eval-every": 0,
        "seed": args.seed,
        "results-dir": str(out / f"{name}-{rule}-{strategy.get('strategy', 'fedavg')}"),
    }
    cfg = RunConfig.from_mapping(values | strategy | settings_of(rule, args))
    mods = [attack(name, partition_id=0)] + ([capturing(captured)] if captured is not None else [])
    return run_in_process(cfg, args.clients, client_app=build_client_app(mods))


def accuracy_table(args: argparse.Namespace, out: Path, captured: dict) -> list[str]:
    """Rows attack × columns rule: "accuracy (Δ vs the same rule, all honest)" and marks."""
    honest: dict[tuple[str, str], float] = {}
    lines = [f"| attack \\ rule | {' | '.join(args.rules)} |", "|---|" + "---:|" * len(args.rules)]
    for name in args.attacks:
        strategy = STRATEGY_OF.get(name, {})
        label = strategy.get("strategy", "fedavg")
        cells = []
        for rule in args.rules:
            if name != "none" and (label, rule) not in honest:  # another strategy's honest reference, first
                reference = run("none", rule, args, out, strategy=strategy)
                honest[label, rule] = 100 * reference["summary"]["seen"]["mean_accuracy"]
            capture = captured if (name, rule) == ("none", args.rules[0]) else None
            try:
                results = run(name, rule, args, out, capture, strategy)
            except RuntimeError as err:  # a run that stops says why, in one line
                cells.append(f"stopped: {str(err).splitlines()[0][:80]}")
                continue
            accuracy = 100 * results["summary"]["seen"]["mean_accuracy"]
            if name == "none":
                honest[label, rule] = accuracy
            cells.append(f"{accuracy:.1f} ({accuracy - honest[label, rule]:+.1f})" + marks(name, rule, results))
        lines.append(f"| {name}{'' if label == 'fedavg' else f' ({label})'} | {' | '.join(cells)} |")
        print(lines[-1], flush=True)
    return lines


def marks(name: str, rule: str, results: dict) -> str:
    """⚠N: N honest nodes recorded as failures; ↑N: under krum and multikrum, N rounds in which
    the rule kept partition 0's (malicious) reply; ↓N: N rounds with an `aggregation_note` (the
    rule gave way to the median or kept the model, or a no-op reply or a copy was not counted)."""
    attackers = {FIRST_NODE + i for i in range(len(ROLES[name]))}
    blamed = {f["node_id"] for f in results["failures"]} - attackers
    rows = results["rounds"]
    picked = sum("partition-0" not in row["left_out"] for row in rows) if name != "none" and "krum" in rule else 0
    fell_back = sum(1 for row in rows if row.get("aggregation_note"))
    return (
        (f" ⚠{len(blamed)}" if blamed else "")
        + (f" ↑{picked}" if picked else "")
        + (f" ↓{fell_back}" if fell_back else "")
    )


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
    cells: dict[str, list[str]] = {rule: [] for rule in args.rules}
    for n in args.timing_nodes:
        states = [
            {k: v + 1e-3 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v for k, v in s.items()}
            for s in (models[i % len(models)] for i in range(n))
        ]
        weights = [208.0] * n
        aggregators = {}
        for rule in args.rules:
            settings = settings_of(rule, args)
            aggregators[rule] = Aggregator(settings["aggregation"], settings.get("clip-norm", 0.0))
        best = dict.fromkeys(args.rules, float("inf"))
        for attempt in range(args.repeats + 1):
            for rule, aggregator in aggregators.items():
                start = time.perf_counter()
                aggregator(states, weights, reference)
                if attempt:  # the first pass warms up
                    best[rule] = min(best[rule], time.perf_counter() - start)
        for rule in args.rules:
            cells[rule].append(f"{1000 * best[rule]:.1f}")
    lines += [f"| {rule} | {' | '.join(cells[rule])} |" for rule in args.rules]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dataset", default="digits", help="digits | mnist5k | ... (run-config dataset)")
    parser.add_argument("--partition", default="iid")
    parser.add_argument("--clip-norm", type=float, default=2.0)
    parser.add_argument("--max-node-examples", type=int, default=250)
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS))
    parser.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES), help="the table's columns")
    parser.add_argument("--timing-nodes", nargs="*", type=int, default=[5, 20, 50], help="none: no timings")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=usable_cores(), help="torch threads for the timings")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.attacks = ["none"] + [a for a in args.attacks if a != "none"]  # the honest reference first
    out = Path(args.out or tempfile.mkdtemp(prefix="florist-robustness-"))
    captured: dict = {}
    table = accuracy_table(args, out, captured)
    timings = timing_table(args, captured) if args.timing_nodes else []
    print(
        f"\nFedAvg, {args.dataset} ({args.partition}), {args.clients} nodes of which partition 0 "
        "(and 1: colluders, noop2) is malicious (standardizer: PeFLL with hn-standardize), "
        f"{args.rounds} rounds, seed {args.seed}; final seen accuracy % (points vs the same rule, all honest); "
        f"mean+clip: clip-norm {args.clip_norm:g}, mean+cap: max-node-examples {args.max_node_examples}; "
        "⚠N: N honest nodes recorded as failures; ↑N: N rounds in which krum or multikrum kept partition 0's "
        "reply; ↓N: N rounds with an aggregation_note (the rule gave way, or a no-op or copy was not counted)\n"
    )
    print("\n".join(table))
    if timings:
        print(f"\nAggregation time per round (best of {args.repeats}, {torch.get_num_threads()} torch threads):\n")
        print("\n".join(timings))


if __name__ == "__main__":
    main()
