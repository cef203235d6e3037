"""privacy_utility.py's `--many-clients` rows: user-level `dp = "central"` where the node count makes
it work. Thousands of FedProx Synthetic(α, β) clients in process (`model="mlp"`, the model florist
uses for them), each round a Poisson sample at rate q of the seen ones; FedAvg without dp, then at
each ε, each with every server momentum asked for (FedAvgM's step on the noised aggregate:
post-processing, it spends no ε). Per coordinate the noise on the mean is σ·C/m, m = q·(seen
clients): what 16 clients a round cannot carry, 80 may.

    python benchmarks/privacy_utility.py --many-clients [--clients 2000] [--fraction 0.05] \
        [--dataset synthetic:1,1] [--rounds 100] [--epsilons 1 3 8] [--sigmas 0.01] [--seeds 1] [--dp-clip 1.0] \
        [--lr 0.2] [--modes none central] [--server-momentum 0 0.9] [--server-lr 1] [--out DIR] [--json OUT]

Each row: seen and unseen clients' mean accuracy (weighted by their test splits, as florist's
summary weighs them; unseen: never trained, scored with the global model), the seen clients' plain
mean (each client counts once, as each weighs once in dp's mean), σ, ε as the accountant gives it
for the rounds run (the runs draw seeded noise, so their own rows report none: florist's rule for
seeded noise), the share of updates dp-clip cut, the clients a round trained on average (m), wall
and CPU seconds. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from florist.common import privacy
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags only the many-clients rows read (the others are privacy_utility.py's own)."""
    group = parser.add_argument_group("many clients (user-level dp, --many-clients)")
    group.add_argument(
        "--many-clients", action="store_true", help="the many-clients user-level rows instead (--modes none, central)"
    )
    group.add_argument("--clients", type=int, default=2000, help="clients in all, unseen-fraction 0.2 held out")
    group.add_argument("--fraction", type=float, default=0.05, help="q: each seen client's chance to train a round")
    group.add_argument("--dataset", default="synthetic:1,1")
    group.add_argument("--server-momentum", nargs="+", type=float, default=[0.0], help="β of FedAvgM, each a row")
    group.add_argument("--sigmas", nargs="+", type=float, default=[], help="central dp at these σ (ε reported)")
    group.add_argument("--server-lr", type=float, default=1.0, help="η of FedAvgM (with β > 0 only)")


def cells(args: argparse.Namespace) -> list[tuple[float, float, float]]:
    """(ε, σ, β): no dp (ε = ∞, `--modes none`) first; then, under `--modes central`, each σ of `--sigmas`
    (smallest first, ε only reported), then each ε, loosest first, σ calibrated (0); each with every β."""
    budgets = [(math.inf, 0.0)] if "none" in args.modes else []
    if "central" in args.modes:
        budgets += [(math.inf, sigma) for sigma in sorted(args.sigmas)]
        budgets += [(eps, 0.0) for eps in sorted(args.epsilons, reverse=True)]
    return [(eps, sigma, beta) for eps, sigma in budgets for beta in args.server_momentum]


def run(eps: float, given: float, beta: float, seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One in-process FedAvg run of `args.clients` clients; its figures as a row."""
    folder = out / f"many-{eps:g}-s{given:g}-m{beta:g}-seed{seed}"
    values = {
        "strategy": "fedavg",
        "dataset": args.dataset,
        "model": "mlp",
        "lr": args.lr,
        "fraction-train": args.fraction,
        "min-train-nodes": 1,
        "num-server-rounds": args.rounds,
        "eval-every": 0,
        "seed": seed,
        "results-dir": str(folder),
        "models-root": str(folder / "nodes"),
    }
    if beta:
        values |= {"server-momentum": beta, "server-lr": args.server_lr}
    if math.isfinite(eps) or given:
        values |= {"dp": "central", "dp-noise-seed": seed}
        values |= {"dp-epsilon": eps} if math.isfinite(eps) else {"dp-noise-multiplier": given}
        values |= {"dp-clip": args.dp_clip} if args.dp_clip is not None else {}
    cfg = RunConfig.from_mapping(values)
    wall, cpu = time.perf_counter(), time.process_time()
    results = run_in_process(cfg, args.clients)
    rounds = results["rounds"]
    trained = [sum(e["nodes"] for e in r["exchanges"] if e["type"].startswith("train")) for r in rounds]
    sigma = rounds[-1].get("dp_noise_multiplier") if rounds else None
    seen = sum(1 for c in results["clients"] if c["seen"])
    q = math.ceil(args.fraction * seen) / seen  # the rate the ledger accounts: a round's expected count / seen
    return {
        "epsilon": eps,
        "sigma_given": given,
        "momentum": beta,
        "seed": seed,
        "seen": results["summary"]["seen"]["mean_accuracy"],
        "unseen": results["summary"].get("unseen", {}).get("mean_accuracy"),
        "per_client": float(np.mean([c["accuracy"] for c in results["clients"] if c["seen"]])),
        "sigma": sigma,
        "epsilon_spent": privacy.tightest(((q, sigma),) * len(rounds), cfg.dp_delta)[0] if sigma else None,
        "clipped": sum(r.get("dp_clipped", 0) for r in rounds) / max(1, sum(trained)) if sigma else None,
        "per_round": float(np.mean(trained)) if trained else 0.0,
        "seen_clients": seen,
        "stopped": results.get("stopped") or ("" if results["complete"] else "incomplete"),
        "seconds": time.perf_counter() - wall,
        "cpu_seconds": time.process_time() - cpu,
    }


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """One line per (ε, β), over its seeds."""
    lines = [
        "| dp | ε | server momentum | seen mean | seen, per client | unseen mean | σ | ε (accountant) | clipped "
        "| m a round | s a run |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for eps, given, beta in cells(args):
        group = [r for r in rows if (r["epsilon"], r["sigma_given"], r["momentum"]) == (eps, given, beta)]
        if not group:
            continue
        seen, unseen = [r["seen"] for r in group], [r["unseen"] for r in group if r["unseen"] is not None]
        spread = f" ± {100 * np.std(seen):.1f}" if len(seen) > 1 else ""
        sigma, spent = group[0]["sigma"], max((r["epsilon_spent"] or 0) for r in group)
        clipped = np.mean([r["clipped"] for r in group]) if sigma else None
        budget = f"σ {given:g} given" if given else "∞" if math.isinf(eps) else f"{eps:g}"
        lines.append(
            f"| {'central' if sigma else 'none'} | {budget} "
            f"| {beta:g}{f' (η {args.server_lr:g})' if beta else ''} | {100 * np.mean(seen):.1f}{spread} "
            f"| {100 * np.mean([r['per_client'] for r in group]):.1f} "
            f"| {f'{100 * np.mean(unseen):.1f}' if unseen else '–'} | {f'{sigma:.3g}' if sigma else '–'} "
            f"| {f'{spent:.3g}' if sigma else '–'} | {f'{100 * clipped:.0f} %' if clipped is not None else '–'} "
            f"| {np.mean([r['per_round'] for r in group]):.1f} | {np.mean([r['seconds'] for r in group]):.0f} |"
        )
    return lines


def main(args: argparse.Namespace) -> None:
    """Every (ε, β) cell over the seeds, a line each as it ends, then the table (and `--json`)."""
    out = Path(args.out or tempfile.mkdtemp(prefix="florist-many-clients-"))
    logging.getLogger("flwr").setLevel(logging.WARNING)  # as `simulate` in process: the rows say how far it got
    rows = []
    for eps, given, beta in cells(args):
        for seed in args.seeds:
            rows.append(run(eps, given, beta, seed, args, out))
            r = rows[-1]
            print(
                f"ε={eps:g} σ={given or r['sigma'] or 0:.3g} β={beta:g} seed {seed}: seen {100 * r['seen']:.1f} %, "
                f"unseen {100 * (r['unseen'] or 0):.1f} %; {r['seconds']:.0f} s ({r['cpu_seconds']:.0f} CPU-s) "
                f"{r['stopped']}",
                flush=True,
            )
    clip = args.dp_clip if args.dp_clip is not None else RunConfig.__dataclass_fields__["dp_clip"].default
    print(
        f"\n{args.dataset}, mlp, FedAvg, lr {args.lr:g}, {args.clients} clients (20% unseen), Poisson q = "
        f"{args.fraction:g}, {args.rounds} rounds, dp-clip {clip:g}, δ = 1e-5, seeds "
        f"{', '.join(map(str, args.seeds))}; noise seeded by the seed; accuracies %, mean (± std) over seeds\n"
    )
    print("\n".join(table(rows, args)))
    print(f"\nruns in {out}")
    if args.json:
        runs = [r | {"epsilon": None if math.isinf(r["epsilon"]) else r["epsilon"]} for r in rows]  # ∞: null
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        Path(args.json).write_text(json.dumps({"settings": settings, "runs": runs}, indent=1) + "\n")
