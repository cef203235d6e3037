"""What several commands share: their options (the run's, the scenario's, Ray's resources per
client, the federation's), the run config those make, and the summary a finished run prints."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from florist.common import devices
from florist.config import STRATEGY_NAMES, RunConfig, parse_overrides, parse_trackers
from florist.strategies import STRATEGIES

DEFAULT_NODES = {"simulate": 20, "deploy-local": 3, "local-federation": 3}


def count(text: str) -> int:
    """A number of nodes or clients: an integer >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def positive_float(text: str) -> float:
    """A size or amount: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--strategy",
        choices=STRATEGY_NAMES,
        metavar="STRATEGY",
        help="algorithm to run (default: fedavg): " + "; ".join(f"{n} = {s.summary}" for n, s in STRATEGIES.items()),
    )
    scenario_options(parser)
    parser.add_argument("--seed", type=int, help="seed for partitions, splits, init and sampling (default: 1)")
    parser.add_argument("--results-dir", help="output folder (default: results)")
    parser.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the run whose results folder is DIR from its last "
        "finished round, with its own config (flags given beside must agree with it)",
    )
    track_option(parser)


def track_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--track",
        type=trackers,
        metavar="NAMES",
        help="also log every round, the summary and the report to these experiment trackers, comma-separated: "
        "tensorboard, mlflow, wandb (the tracking extra: pip install -e '.[tracking]'); offline, under the results "
        "folder, unless "
        "MLFLOW_TRACKING_URI, a W&B login or WANDB_MODE say otherwise. A resumed run goes on in the same tracker runs",
    )


def trackers(text: str) -> str:
    """`--track`'s names, checked now (one line listing the valid ones)."""
    try:
        return ",".join(parse_trackers(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def scenario_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset",
        help='digits | mnist5k (embedded; use model="lenet" on mnist5k) | '
        'synthetic:ALPHA,BETA (FedProx\'s; use model="mlp") | a Hugging Face id (uoft-cs/cifar10, '
        "flwrlabs/femnist, ...) | a local folder (parquet/csv/json files, or one subfolder of images per "
        "class; the same path on every Ray node) (default: digits)",
    )
    parser.add_argument(
        "--partition",
        help="iid | dirichlet:ALPHA (each label spread over the clients) | inner-dirichlet:ALPHA (equal-size "
        "clients, each one's label mix drawn from Dir(ALPHA): the split of papers at tiny ALPHA) | pathological:K | "
        "natural:COLUMN (hub data) (default: dirichlet:0.3)",
    )
    parser.add_argument(
        "--shift",
        help="none | relabel:K | rotate:K: K clusters of clients with their own label "
        "permutation or image rotation (default: none)",
    )
    parser.add_argument("--rounds", type=int, help="server rounds (default: 30)")
    parser.add_argument("--unseen-fraction", type=float, help="fraction of clients held out of training (default: 0.2)")
    parser.add_argument(
        "--run-config",
        metavar='"k=v ..."',
        help='any other run-config keys, as for `flwr run --run-config`, e.g. "lr=0.1 local-epochs=2"',
    )


def resource_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cpus-per-client",
        type=float,
        default=1.0,
        metavar="N",
        help="CPU cores Ray gives each simulated client, fractions allowed; its torch uses that many "
        "threads (default: 1)",
    )
    parser.add_argument(
        "--gpus-per-client",
        type=float,
        metavar="N",
        help="GPUs Ray gives each simulated client, fractions allowed (default: 0.25 where torch sees a GPU, or "
        "with --ray-address where the cluster has one, else 0)",
    )
    parser.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="run the clients on this running Ray cluster: HOST:PORT of its head (`ray start --head --port PORT`), "
        "ray://HOST:PORT or auto; every node needs florist's Python environment and the run's data (see the README). "
        "Default: $FLORIST_RAY_ADDRESS, else a private Ray on this machine, on loopback only ('' asks for that)",
    )


RUNTIMES = ("simulation", "in-process")


MANY_CORES = 4  # from here on Ray's clients side by side make up for its start-up (25-35 s)


def runtime_option(parser: argparse.ArgumentParser, default: str = "") -> None:
    parser.add_argument(
        "--runtime",
        choices=RUNTIMES,
        help="simulation: Flower's simulation runtime (Ray: clients run side by side, each on its share of the "
        "cores and GPUs; for many cores, GPUs shared by clients, Ray clusters); in-process: the same ServerApp and "
        "ClientApp called one after the other in this process, no Ray (the same results, no start-up; best on a "
        f"small machine and for short runs). Default: {default}simulation with --ray-address (or "
        f"FLORIST_RAY_ADDRESS), on a GPU or on {MANY_CORES}+ cores, else in-process",
    )


def chosen_runtime(args: argparse.Namespace) -> str:
    """`--runtime`, or the one that suits this run where none is given (`runtime_option`'s help).
    Measured on 2 cores (benchmarks/first_round.py): 20 clients, 30 rounds took 44.8 s in-process
    and 63.1 s with Ray; 6 clients reached round 1 after 10.6 s in-process and 32.4 s with Ray."""
    from florist.runners.raycluster import ADDRESS_ENV

    if args.runtime:
        return args.runtime
    if args.ray_address or (args.ray_address is None and os.environ.get(ADDRESS_ENV)):
        return "simulation"
    if (os.cpu_count() or 1) >= MANY_CORES or (args.gpus_per_client or 0) > 0:
        return "simulation"
    if args.gpus_per_client is None:  # by default clients share a GPU where there is one
        from florist.runners.simulation import gpu_count

        return "simulation" if gpu_count() else "in-process"
    return "in-process"


def run_simulated(
    runtime: str, cfg: RunConfig, num_clients: int, on_round, resources: dict[str, Any], address: str | None = None
) -> dict:
    """One run in the chosen runtime (with `address`, on that Ray cluster); returns its results."""
    if runtime == "in-process":
        import logging

        from florist.runners.inprocess import run_in_process

        logging.getLogger("flwr").setLevel(logging.WARNING)  # the progress display says how far it got
        return run_in_process(cfg, num_clients, on_round=on_round, cpus_per_client=resources["num_cpus"])
    from florist.runners.simulation import simulate_in_child

    return simulate_in_child(cfg, num_clients, on_round, resources, address)


def executor_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--executor",
        choices=("warm", "flower"),
        default="warm",
        help="how SuperNodes run ClientApps: warm (florist's fast path: preloaded, one fork per message; other apps "
        "fall back to flower) or flower (Flower's own: a new process per message). Default: warm",
    )


def federation_options(parser: argparse.ArgumentParser) -> None:
    executor_option(parser)
    parser.add_argument("--num-nodes", type=count, help="SuperNodes to start (default: 3)")
    parser.add_argument("--tls", action="store_true", help="TLS on the Fleet API (certificates made on first use)")
    parser.add_argument("--auth", action="store_true", help="SuperNode authentication (needs --tls)")
    parser.add_argument(
        "--max-message-mb",
        type=positive_float,
        metavar="MB",
        help="the largest gRPC message the SuperLink accepts, in MiB (default: 4 x the largest message of the "
        "run's model, at least 4 MiB; local-federation: 20 MiB, which any model's messages fit)",
    )


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The run-config values the user gave: the flags, `--run-config` on top."""
    names = {
        "strategy": "strategy",
        "dataset": "dataset",
        "partition": "partition",
        "shift": "shift",
        "num-server-rounds": "rounds",
        "seed": "seed",
        "unseen-fraction": "unseen_fraction",
        "results-dir": "results_dir",
        "trackers": "track",
    }
    flags = {key: getattr(args, name, None) for key, name in names.items()}
    return {k: v for k, v in flags.items() if v is not None} | parse_overrides(args.run_config or "")


def run_config(args: argparse.Namespace) -> tuple[RunConfig, int]:
    """The run config from the shared run flags, `--run-config` on top, and the node count;
    with `--resume DIR`, the run's own, which any flag given beside must agree with."""
    values = given(args)
    if not args.resume:
        num_nodes = args.num_nodes or DEFAULT_NODES[args.command]
        return RunConfig.from_mapping({"min-nodes": num_nodes} | values), num_nodes
    from florist.server.checkpoint import Checkpoint, resumed_config

    num_nodes = len(Checkpoint.load(args.resume).nodes)
    if args.num_nodes not in (None, num_nodes):
        raise ValueError(f"cannot resume from {args.resume}: its run had {num_nodes} nodes, not {args.num_nodes}")
    return resumed_config(args.resume, values), num_nodes


def checked_config(args: argparse.Namespace) -> tuple[RunConfig, int]:
    """The run config and node count, refused before any work starts if anything about them
    cannot work."""
    from florist.runners.preflight import check_run

    cfg, num_nodes = run_config(args)
    if not getattr(args, "ray_address", None):  # a Ray cluster's nodes have devices of their own
        devices.resolve(cfg.device, "device")  # this machine runs the nodes: one it lacks fails now, in one line
    for warning in check_run(cfg, num_nodes):
        print(f"florist: warning: {warning}", file=sys.stderr)
    return cfg, num_nodes


def node_configs(num_nodes: int, state_root: Path) -> list[dict[str, Any]]:
    return [
        {
            "partition-id": i,
            "num-partitions": num_nodes,
            "node-key": f"partition-{i}",
            "state-dir": str(state_root / "node-state"),
        }
        for i in range(num_nodes)
    ]


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def decode_data(progress, cfg: RunConfig, num_clients: int) -> None:
    """Decode every client's partition of a Hugging Face or folder dataset into the data cache
    before the clients start, with a progress bar (the clients then read it in milliseconds);
    nothing for the embedded datasets."""
    from florist.common import scenarios

    if scenarios.parse_dataset(cfg.dataset)[0] != "hub":
        return
    from florist.common.hub import hub_client

    task = progress.add_task("decoding data", total=num_clients, status="")
    for pid in range(num_clients):
        show = lambda done, total: progress.update(task, description=f"decoding partition {pid}: {done}/{total}")  # noqa: E731
        hub_client(pid, num_clients, cfg, report=show)
        progress.update(task, completed=pid + 1)
    progress.update(task, description="data decoded")


def print_summary(results: dict[str, Any], console, wall: float) -> None:
    from rich.markup import escape
    from rich.table import Table

    from florist.server.report import summary_rows

    table = Table(title=f"florist · {results['strategy']} · {results['config']['partition']}")
    for column in ("strategy", "clients", "n", "mean acc. (%)", "bottom decile (%)"):
        table.add_column(column, justify="right" if column[0] in "nmb" else "left")
    for row in summary_rows(results):
        table.add_row(*row)
    console.print(table)
    failed: dict[tuple[str, str], list[int]] = {}
    for failure in results.get("failures", []):
        failed.setdefault((failure["node"], failure["reason"]), []).append(failure["round"])
    for (node, reason), rounds in failed.items():
        console.print(
            f"[yellow]{escape(node)} left out of round(s) {', '.join(map(str, sorted(set(rounds))))}:[/] "
            f"{escape(reason)}",
            highlight=False,
        )
    console.print(
        f"wall time {wall:.1f} s · results in {results['config']['results-dir']}/ (results.json, report.md, plots)"
    )
