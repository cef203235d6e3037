"""What several commands share: their options (the run's, the scenario's, Ray's resources per
client, the federation's) and what those ask of a run (`launch`, `federation`)."""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Any

from florist.apps.registry import STRATEGIES
from florist.config import RunConfig, parse_overrides, parse_trackers
from florist.runners.launch import Federation, Launch

DEFAULT_NODES = {"simulate": 20, "deploy-local": 3, "local-federation": 3, "compare": 20}


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


def path(text: str) -> str:
    """A file or folder the user typed, made absolute where they typed it: the SuperLink, the
    SuperNodes and `flwr run` that use it work in folders of their own."""
    return os.path.abspath(os.path.expanduser(text))


def dataset(text: str) -> str:
    """A dataset as `path` makes it absolute where it names a folder here; an embedded name,
    `synthetic:...`, a hub id, or a folder that is not there (refused as typed) as it is."""
    return path(text) if text and os.path.isdir(os.path.expanduser(text)) else text


def absolute(values: dict[str, Any]) -> dict[str, Any]:
    """Run-config values with the paths they hold made absolute (`dataset`, `tracking-dir`), from
    a flag, --run-config or a preset alike."""
    fixed = {"dataset": dataset, "tracking-dir": path}
    return {k: fixed[k](v) if k in fixed and isinstance(v, str) and v else v for k, v in values.items()}


def run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--strategy",
        choices=tuple(STRATEGIES),
        metavar="STRATEGY",
        help="algorithm to run (default: fedavg): " + "; ".join(f"{n} = {s.summary}" for n, s in STRATEGIES.items()),
    )
    scenario_options(parser)
    parser.add_argument("--seed", type=int, help="seed for partitions, splits, init and sampling (default: 1)")
    parser.add_argument("--results-dir", help="output folder (default: results)")
    parser.add_argument(
        "--resume",
        type=path,
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
        type=dataset,
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
    """`--runtime`, or the one that suits this run where none is given (`runtime_option`'s help):
    a flag's default, so the command line's to settle (the runners only say what Ray and torch
    see). Measured on 2 cores (benchmarks/first_round.py): 20 clients, 30 rounds took 44.8 s in-process
    and 63.1 s with Ray; 6 clients reached round 1 after 10.6 s in-process and 32.4 s with Ray."""
    from florist.runners.raycluster import ADDRESS_ENV

    if args.runtime:
        return args.runtime
    if args.ray_address or (args.ray_address is None and os.environ.get(ADDRESS_ENV)):
        return "simulation"
    if (args.gpus_per_client or 0) > 0:  # a simulation's flag (without Ray: its runner says what to install)
        return "simulation"
    if importlib.util.find_spec("ray") is None:  # an install without the simulation extra (a box's)
        return "in-process"
    if (os.cpu_count() or 1) >= MANY_CORES:
        return "simulation"
    if args.gpus_per_client is None:  # by default clients share a GPU where there is one
        from florist.runners.simulation import gpu_count

        return "simulation" if gpu_count() else "in-process"
    return "in-process"


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


def launch(args: argparse.Namespace, beneath: dict[str, Any] | None = None, strategies: tuple[str, ...] = ()) -> Launch:
    """The run the flags ask for: the run-config values given (`given`, on top of `beneath`), the
    nodes, the run to resume, and where simulated nodes run (`--runtime`, or the one that suits).
    A run config that cannot work is refused here, before torch is imported (`checked_early`; choosing
    the runtime may import it, to count GPUs)."""
    values = absolute((beneath or {}) | given(args))
    resume = getattr(args, "resume", None)
    if not resume:  # a resumed run's values are checked with the run they continue (preflight)
        checked_early(values, strategies)
    where = {}
    if "runtime" in args:
        where = {"runtime": chosen_runtime(args), "ray_address": args.ray_address}
        where |= {"cpus_per_client": args.cpus_per_client, "gpus_per_client": args.gpus_per_client}
    return Launch(values, args.num_nodes, DEFAULT_NODES[args.command], resume, **where)


def checked_early(values: dict[str, Any], strategies: tuple[str, ...] = ()) -> None:
    """Parse the run config as the run will (an unknown key, a wrong type or value, a strategy that
    `dp = "record"` does not cover: `RunConfig.record_refusal`) and raise its ValueError, in milliseconds:
    nothing here imports torch, which the run's preflight does (seconds). `strategies`: each of them
    in turn (`compare`'s), else the one the values name."""
    for strategy in strategies or (None,):
        RunConfig.from_mapping(values | ({"strategy": strategy} if strategy else {}))


def federation(args: argparse.Namespace) -> Federation:
    """The SuperLink and SuperNodes the federation flags ask for."""
    return Federation(
        state_dir=args.state_dir,
        executor=args.executor,
        tls=args.tls,
        auth=args.auth,
        max_message_mb=args.max_message_mb,
        netns=getattr(args, "netns", False),
        persistent=getattr(args, "persistent", False),
        trust_apps=tuple(getattr(args, "trust_app", ())),
    )


def kept_model(parser: argparse.ArgumentParser) -> None:
    """Which kept model: a node's (its latest, or --run-id's) or a model folder."""
    parser.add_argument(
        "--node-key",
        metavar="K",
        help="the node whose model to use (default: the only node keeping models in the state folder)",
    )
    parser.add_argument(
        "--state-dir",
        type=path,
        metavar="DIR",
        help="node state folder: the node's --state-dir (default: ~/.cache/florist/nodes; deploy-local's nodes: "
        "RESULTS_DIR/federation/node-state)",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--run-id", type=int, metavar="R", help="the model of run R (default: the node's latest)")
    which.add_argument(
        "--model", type=path, metavar="DIR", help="a kept model's folder (<state>/<node>/models/<run id>)"
    )
