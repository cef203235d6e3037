"""OD-PFL under differential privacy: novel-client accuracy against ε and the number of
samples |D| in the descriptor (the shape of the paper's Figure 4).

    python benchmarks/odpfl_privacy.py --run results/odpfl [--epsilons 0.1 0.3 1 3 inf] \
        [--sizes 5 10 20 0] [--repeats 20]

`--run` is the results folder of a finished `odpfl` run (its checkpoint holds the trained
encoder and hypernetwork; its config names the partition). For every novel (held-out) client,
|D| samples of its train split (0: all) are encoded, noised with the Gaussian mechanism for
(ε, δ = dp-delta) exactly as a served node does, mapped to a model by the hypernetwork and
scored on the client's test split; the noise is drawn `--repeats` times. Labels are used only
to score. Prints mean accuracy per (ε, |D|) and the mean σ.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

import florist.apps.registry  # noqa: F401  (hands the run config its strategies)
from florist.common import data as data_lib
from florist.common import training
from florist.common.models import build_model
from florist.config import RunConfig
from florist.strategies.pefll.client import gaussian_sigma, privatize
from florist.strategies.pefll.server import ODPFL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, type=Path)
    parser.add_argument("--epsilons", nargs="+", type=float, default=[0.1, 0.3, 1.0, 3.0, math.inf])
    parser.add_argument("--sizes", nargs="+", type=int, default=[5, 10, 20, 0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    results = json.loads((args.run / "results.json").read_text())
    values = {k: v for k, v in results["config"].items() if v is not None}
    cfg = RunConfig.from_mapping({"public-size": 0} | values)  # runs from before P was set aside used every digit
    if cfg.strategy != "odpfl":
        raise SystemExit(f"{args.run}: an odpfl run is needed, this one ran {cfg.strategy}")
    num = len(results["clients"])
    novel = sorted(data_lib.unseen_partitions(num, cfg.unseen_fraction, cfg.seed))
    clients = [
        data_lib.embedded_client(
            i,
            num,
            cfg.partition,
            cfg.seed,
            cfg.val_fraction,
            cfg.test_fraction,
            cfg.min_partition_size,
            public_size=cfg.public_size,
        )
        for i in novel
    ]
    server = ODPFL(cfg, None, clients[0].input_shape, num - len(novel))
    state = torch.load(args.run / "checkpoint.pt")["state"]
    server.load_state(state)
    model = build_model(cfg.model, clients[0].input_shape, cfg.num_classes)
    rng = np.random.default_rng(0)

    def accuracy(client: data_lib.ClientData, x: torch.Tensor, sigma: float) -> float:
        with torch.no_grad():
            pooled = server.embed.pool(x)  # the node noises the mean, before ψ: as florist's nodes do
            v = server.embed.readout(privatize(pooled, sigma) if sigma > 0 else pooled)
            model.load_state_dict(server.hyper(server.standardizer(v)))
        return float((training.predict_proba(model, client.x_test).argmax(1) == client.y_test).mean())

    print(
        f"{len(novel)} novel clients of {num}, {cfg.partition}, δ = {cfg.settings.dp_delta}; mean test accuracy (%) "
        f"over {args.repeats} noise draws, mean σ in brackets"
    )
    print("| ε | " + " | ".join(f"|D| = {s or 'all'}" for s in args.sizes) + " |")
    print("|---|" + "---:|" * len(args.sizes))
    for epsilon in args.epsilons:
        cells = []
        for size in args.sizes:
            scores, sigmas = [], []
            for client in clients:
                x = torch.from_numpy(client.x_train[rng.permutation(len(client.x_train))[: size or None]])
                sigma = gaussian_sigma(epsilon, cfg.settings.dp_delta, len(x))
                sigmas.append(sigma)
                scores += [accuracy(client, x, sigma) for _ in range(args.repeats if sigma > 0 else 1)]
            cells.append(f"{100 * np.mean(scores):.1f} [{np.mean(sigmas):.2f}]")
        print(f"| {epsilon:g} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
