"""The `florist` command."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from florist.common import devices
from florist.common.config import STRATEGY_NAMES, RunConfig, parse_overrides
from florist.strategies import STRATEGIES

DEFAULT_NODES = {"simulate": 20, "deploy-local": 3, "local-federation": 3}


def _given(args: argparse.Namespace) -> dict[str, Any]:
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
    }
    flags = {key: getattr(args, name, None) for key, name in names.items()}
    return {k: v for k, v in flags.items() if v is not None} | parse_overrides(args.run_config or "")


def _config(args: argparse.Namespace) -> tuple[RunConfig, int]:
    """The run config from the shared run flags, `--run-config` on top, and the node count;
    with `--resume DIR`, the run's own, which any flag given beside must agree with."""
    values = _given(args)
    if not args.resume:
        num_nodes = args.num_nodes or DEFAULT_NODES[args.command]
        return RunConfig.from_mapping({"min-nodes": num_nodes} | values), num_nodes
    from florist.server.checkpoint import Checkpoint, resumed_config

    num_nodes = len(Checkpoint.load(args.resume).nodes)
    if args.num_nodes not in (None, num_nodes):
        raise ValueError(f"cannot resume from {args.resume}: its run had {num_nodes} nodes, not {args.num_nodes}")
    return resumed_config(args.resume, values), num_nodes


def _console():
    from rich.console import Console

    return Console(stderr=True)


def _checked(args: argparse.Namespace) -> tuple[RunConfig, int]:
    """The run config and node count, refused before any work starts if anything about them
    cannot work."""
    from florist.runners.preflight import check_run

    cfg, num_nodes = _config(args)
    devices.resolve(cfg.device, "device")  # this machine runs the nodes: one it lacks fails now, in one line
    for warning in check_run(cfg, num_nodes):
        print(f"florist: warning: {warning}", file=sys.stderr)
    return cfg, num_nodes


def _simulate(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from florist.runners.simulation import client_resources, simulate_in_child
    from florist.server.report import number

    (cfg, num_clients), console, start = _checked(args), _console(), time.monotonic()
    resources = client_resources(args.cpus_per_client, args.gpus_per_client)
    _interrupt_on_signals()
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        _decode_data(progress, cfg, num_clients)
        task = progress.add_task(f"{cfg.strategy} rounds", total=cfg.num_server_rounds, status="starting clients")

        def on_round(row: dict[str, Any]) -> None:
            progress.update(
                task,
                completed=row["round"],
                status=f"loss {number(row['train_loss'], '.3f')}  seen acc {number(row['accuracy'], '.1%')}",
            )

        results = simulate_in_child(cfg, num_clients, on_round, resources)
    print_summary(results, console, time.monotonic() - start)
    return 0


def _compare(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from florist.runners import compare
    from florist.runners.preflight import check_run
    from florist.runners.simulation import client_resources

    strategies, seeds = _names(args.strategies, "--strategies"), _seeds(args.seeds)
    values = {"min-nodes": args.num_clients} | _given(args)
    resources = client_resources(args.cpus_per_client, args.gpus_per_client)
    configs = compare.planned(Path(args.out).expanduser().absolute(), strategies, seeds, values)
    devices.resolve(configs[0].device, "device")
    warnings = {w for cfg in configs for w in check_run(cfg, args.num_clients)}
    for warning in sorted(warnings):
        print(f"florist: warning: {warning}", file=sys.stderr)
    cfg0 = configs[0]
    scenario = (
        f"dataset {cfg0.dataset}, partition {cfg0.partition}, shift {cfg0.shift}, {args.num_clients} clients, "
        f"{cfg0.num_server_rounds} rounds, unseen fraction {cfg0.unseen_fraction}"
    )
    _interrupt_on_signals()
    console = _console()
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        runs = progress.add_task("runs", total=len(configs))
        rounds = progress.add_task("rounds", total=cfg0.num_server_rounds)

        for cfg in configs:
            _decode_data(progress, cfg, args.num_clients)

        def on_run(cfg: RunConfig, reused: bool) -> None:
            done = configs.index(cfg)
            progress.update(
                runs, completed=done, description=f"runs ({cfg.strategy}, seed {cfg.seed}{', kept' * reused})"
            )
            progress.update(rounds, completed=0)

        def runner(cfg: RunConfig, num_clients: int) -> dict[str, Any]:
            on_round = lambda row: progress.update(rounds, completed=row["round"])  # noqa: E731
            if args.runtime == "in-process":
                import logging

                from florist.runners.inprocess import run_in_process

                logging.getLogger("flwr").setLevel(logging.WARNING)  # the progress display says how far it got

                return run_in_process(cfg, num_clients, on_round=on_round, cpus_per_client=resources["num_cpus"])
            from florist.runners.simulation import simulate_in_child

            return simulate_in_child(cfg, num_clients, on_round, resources)

        all_results = compare.compare(configs, args.num_clients, runner, on_run)
        progress.update(runs, completed=len(configs), description="runs")
    compare.write(Path(args.out), all_results, scenario)
    print((Path(args.out) / "compare.md").read_text())
    print(f"compare.md, compare.json and compare.png in {args.out}/")
    return 0


def _decode_data(progress, cfg: RunConfig, num_clients: int) -> None:
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


def _names(text: str, option: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if unknown := [n for n in names if n not in STRATEGIES]:
        raise ValueError(f"{option}: unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}")
    if not names:
        raise ValueError(f"{option}: name at least one strategy")
    return names


def _seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()] or [1]
    except ValueError:
        raise ValueError(f"--seeds: expected comma-separated integers, got {text!r}") from None


def _node_configs(num_nodes: int, state_root: Path) -> list[dict[str, Any]]:
    return [
        {
            "partition-id": i,
            "num-partitions": num_nodes,
            "node-key": f"partition-{i}",
            "state-dir": str(state_root / "node-state"),
        }
        for i in range(num_nodes)
    ]


def _deploy_local(args: argparse.Namespace) -> int:
    import subprocess

    from florist.deploy.federation import LocalFederation
    from florist.deploy.netns import Network, check_usable
    from florist.runners.simulation import Interrupted

    if args.netns:
        check_usable()  # before the run's own checks, which take seconds
    (cfg, num_nodes), console, start = _checked(args), _console(), time.monotonic()
    results_dir = Path(cfg.results_dir).expanduser().resolve()
    cfg = cfg.replace(results_dir=str(results_dir))
    workdir = Path(args.state_dir or results_dir / "federation").expanduser().resolve()
    results_file = results_dir / "results.json"
    _interrupt_on_signals()
    try:
        # The network is made first and removed last, with whatever still runs in it.
        with (
            Network.for_federation(num_nodes) if args.netns else contextlib.nullcontext() as network,
            LocalFederation(
                workdir,
                _node_configs(num_nodes, workdir),
                tls=args.tls,
                auth=args.auth,
                executor=args.executor,
                network=network,
            ) as fed,
        ):
            print(f"federation up in {time.monotonic() - start:.1f} s\n{fed.describe()}", flush=True)
            if not cfg.resume_from:
                results_file.unlink(missing_ok=True)
            rc = subprocess.run(
                fed.run_command(cfg.to_mapping()), env=fed.env, cwd=workdir, start_new_session=True
            ).returncode
    except KeyboardInterrupt:
        saved = json.loads(results_file.read_text()) if results_file.exists() else None
        raise Interrupted(saved, results_dir) from None
    if rc != 0 or not results_file.exists():
        raise RuntimeError(f"the run failed (flwr run exited {rc}); logs in {workdir / 'logs'}")
    print_summary(json.loads(results_file.read_text()), console, time.monotonic() - start)
    return 0


def _ignore_signals() -> None:
    import signal

    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)


def _forget_interrupt() -> None:
    """CPython (3.11) records a KeyboardInterrupt that escapes code run by `exec` (imports run
    such code: dataclasses, typing, pydantic) even when it is caught later, and then ends the
    process by SIGINT instead of with our exit status. A successful `exec` clears the record."""
    exec("")


def _interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM both raise KeyboardInterrupt, so the processes we started are stopped
    either way (and Ctrl-C works even where the shell started us with SIGINT ignored). Only the
    first does: a second Ctrl-C, pressed while that stop runs (a few seconds), would cut it
    short and leave processes behind."""
    import signal

    def interrupt(*_: object) -> None:
        _ignore_signals()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def _local_federation(args: argparse.Namespace) -> int:
    from florist.common.data import parse_partition
    from florist.deploy.federation import LocalFederation

    parse_partition(args.partition)  # it goes into the printed run line: refuse a wrong one now
    workdir = Path(args.state_dir).expanduser().resolve()
    _interrupt_on_signals()
    num_nodes = args.num_nodes or DEFAULT_NODES[args.command]
    with LocalFederation(
        workdir,
        _node_configs(num_nodes, workdir),
        tls=args.tls,
        auth=args.auth,
        executor=args.executor,
        persistent=args.persistent,
    ) as fed:
        print(fed.describe().replace("...", f'partition="{args.partition}"'), flush=True)
        print("Running; Ctrl-C stops the SuperLink and SuperNodes started here.", flush=True)
        try:
            while fed.superlink.alive():
                fed.ensure_runs_served()
                time.sleep(1)
            print(f"the SuperLink exited:\n{fed.superlink.tail()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("stopping...", flush=True)
    return 0


def _certs(args: argparse.Namespace) -> int:
    from florist.deploy.certs import make_certificates

    paths = make_certificates(args.out, args.hosts.split(","), args.num_nodes)
    print(f"CA: {paths['ca']}\nSuperLink certificate: {paths['server_cert']} (key {paths['server_key']})")
    print(f"SuperNode keys: {Path(args.out) / 'keys'}/node-<i> and node-<i>.pub, i = 0..{args.num_nodes - 1}")
    return 0


def _join(args: argparse.Namespace) -> int:
    from florist.deploy.join import join

    _interrupt_on_signals()
    return join(
        args.superlink,
        args.data_dir,
        root_certificates=args.root_certificates,
        auth_key=args.auth_key,
        state_dir=args.state_dir,
        node_key=args.node_key,
        num_classes=args.num_classes,
        max_wait_time=args.max_wait_time,
        executor=args.executor,
        device=args.device,
    )


def _supernode(args: argparse.Namespace) -> int:
    from florist.deploy.supernode import run

    run(args.executor, args.flower_args, args.preload, args.fork_server)
    return 0


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


def _run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--strategy",
        choices=STRATEGY_NAMES,
        metavar="STRATEGY",
        help="algorithm to run (default: fedavg): " + "; ".join(f"{n} = {s.summary}" for n, s in STRATEGIES.items()),
    )
    _scenario_options(parser)
    parser.add_argument("--seed", type=int, help="seed for partitions, splits, init and sampling (default: 1)")
    parser.add_argument("--results-dir", help="output folder (default: results)")
    parser.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the run whose results folder is DIR from its last "
        "finished round, with its own config (flags given beside must agree with it)",
    )


def _scenario_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset",
        help='digits | mnist5k (embedded; use model="lenet" on mnist5k) | '
        'synthetic:ALPHA,BETA (FedProx\'s; use model="mlp") | a Hugging Face id or local folder '
        "(default: digits)",
    )
    parser.add_argument("--partition", help="iid | dirichlet:ALPHA | pathological:K (default: dirichlet:0.3)")
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


def _resource_options(parser: argparse.ArgumentParser) -> None:
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
        help="GPUs Ray gives each simulated client, fractions allowed (default: 0.25 where torch sees a GPU, else 0)",
    )


def _executor_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--executor",
        choices=("warm", "flower"),
        default="warm",
        help="how SuperNodes run ClientApps: warm (florist's fast path: preloaded, one fork per message; other apps "
        "fall back to flower) or flower (Flower's own: a new process per message). Default: warm",
    )


def _federation_options(parser: argparse.ArgumentParser) -> None:
    _executor_option(parser)
    parser.add_argument("--num-nodes", type=_count, help="SuperNodes to start (default: 3)")
    parser.add_argument("--tls", action="store_true", help="TLS on the Fleet API (certificates made on first use)")
    parser.add_argument("--auth", action="store_true", help="SuperNode authentication (needs --tls)")


def _datastore_add(args: argparse.Namespace) -> int:
    from florist.client.state import NodeState
    from florist.strategies.knnper.client import add_samples
    from florist.strategies.knnper.spec import KNNPER

    state = NodeState(args.state_dir, args.node_key, KNNPER.name)
    before, after = add_samples(state, args.data_dir)
    print(
        f"datastore of node {args.node_key!r} ({state.folder}): {before} -> {after} entries from the train split "
        f"of {args.data_dir} (its test split is never added)"
    )
    return 0


def _public_hash(args: argparse.Namespace) -> int:
    from florist.common import data

    print(f'public-hash = "{data.fingerprint(data.folder_public(args.public_dir, args.num_classes))}"')
    return 0


def _count(text: str) -> int:
    """A number of nodes or clients: an integer >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line and a hint, not the whole usage text."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the options)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"florist {version('florist')} (Flower {version('flwr')})"
    except PackageNotFoundError:
        return "florist (not installed as a package)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="florist", description="Personalized federated learning on Flower: simulate, deploy, join.")
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also FLORIST_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sim = sub.add_parser(
        "simulate",
        help="run a strategy in Flower's simulation runtime on the embedded digits",
        description="Run one strategy in Flower simulation (one process, Ray workers) and print the "
        "seen/unseen summary. Writes results.json, report.md and plots to --results-dir.",
    )
    _run_options(sim)
    sim.add_argument(
        "--num-clients",
        type=_count,
        dest="num_nodes",
        help=f"simulated SuperNodes = partitions (default: {DEFAULT_NODES['simulate']})",
    )
    _resource_options(sim)
    sim.set_defaults(func=_simulate)

    dep = sub.add_parser(
        "deploy-local",
        help="one-shot real deployment: SuperLink + SuperNodes on 127.0.0.1, run, collect, stop",
        description="Start a SuperLink and --num-nodes SuperNodes as separate processes on 127.0.0.1 (gRPC Fleet "
        "API), submit the run with `flwr run`, stream its log, print the summary, and stop every process it started.",
    )
    _run_options(dep)
    _federation_options(dep)
    dep.add_argument(
        "--netns",
        action="store_true",
        help="Linux, root: the SuperLink and each SuperNode in a network namespace of its own, with "
        "its own address on a private virtual network (no shared loopback), all removed on exit",
    )
    dep.add_argument(
        "--state-dir",
        help="federation folder: database, certificates, keys, logs, node state (default: RESULTS_DIR/federation)",
    )
    dep.set_defaults(func=_deploy_local)

    fed = sub.add_parser(
        "local-federation",
        help="start a SuperLink + SuperNodes on 127.0.0.1 and keep them running",
        description="Start a SuperLink and --num-nodes SuperNodes (embedded digits partitions) on 127.0.0.1 with "
        "free ports, wait until all are connected, print the addresses and the `flwr run` line, and run until "
        "Ctrl-C, which stops exactly the processes started here.",
    )
    _federation_options(fed)
    fed.add_argument("--partition", default="dirichlet:0.3", help="partition to put in the printed run line")
    fed.add_argument(
        "--state-dir",
        default="florist-federation",
        help="federation folder: certificates, keys, logs, node state, and with --persistent the "
        "SuperLink's database (default: ./florist-federation)",
    )
    fed.add_argument(
        "--persistent",
        action="store_true",
        help="keep the SuperLink's state in STATE_DIR/superlink.db, so that a restarted SuperLink keeps "
        "node identities and registered keys (SQLite makes every exchange 2-3 times slower)",
    )
    fed.set_defaults(func=_local_federation)

    certs = sub.add_parser(
        "certs",
        help="make a CA, a SuperLink certificate and SuperNode key pairs",
        description="Write ca.crt/ca.key, server.pem/server.key (SANs from --hosts, plus 127.0.0.1) and "
        "keys/node-<i>, keys/node-<i>.pub (ECDSA P-384, OpenSSH format) to --out.",
    )
    certs.add_argument("--out", required=True, help="output folder")
    certs.add_argument(
        "--hosts", required=True, help='names/IPs SuperNodes dial, comma-separated, e.g. "superlink,10.0.0.5"'
    )
    certs.add_argument("--num-nodes", type=_count, default=3, help="SuperNode key pairs to make (default: 3)")
    certs.set_defaults(func=_certs)

    join = sub.add_parser(
        "join",
        help="start a SuperNode on this box and join a running federation",
        description="Check the data folder, then start a SuperNode for this box pointed at the SuperLink's Fleet "
        "API, with node config data-dir, node-key and state-dir. Explains failures: unreachable SuperLink, "
        "certificate mismatch, key not registered, ill-formed data.",
    )
    join.add_argument("--superlink", required=True, metavar="HOST:PORT", help="the SuperLink's Fleet API address")
    join.add_argument("--data-dir", required=True, help="train.npz + test.npz, or ImageFolder trees train/ and test/")
    join.add_argument("--root-certificates", metavar="CA", help="CA certificate of the SuperLink (enables TLS)")
    join.add_argument(
        "--auth-key", metavar="KEY", help="this node's private key (its .pub registered on the SuperLink)"
    )
    join.add_argument("--state-dir", help="node state folder (default: ~/.cache/florist/nodes)")
    join.add_argument("--node-key", help="stable name of this node (default: the host name)")
    join.add_argument("--num-classes", type=int, default=10, help="label range to check the data against (default: 10)")
    join.add_argument(
        "--device",
        help="where this node trains, overriding the run's device: auto | cpu | cuda | "
        "cuda:N | mps (default: the run's, auto)",
    )
    join.add_argument(
        "--max-wait-time", type=float, default=60.0, help="give up connecting after this many seconds (default: 60)"
    )
    _executor_option(join)
    join.set_defaults(func=_join)

    node = sub.add_parser(
        "supernode",
        help="run a Flower SuperNode with florist's fast path (flower-supernode's options, plus --executor)",
        description="Flower's SuperNode (every option of `flower-supernode --help` is accepted and passed on) with "
        "florist's deployment fast path: polling that is quick while messages flow, and with --executor warm a "
        "warm executor that runs florist's ClientApp in a forked child per message instead of a new Python "
        "process. Runs in the foreground; Ctrl-C or SIGTERM stops the SuperNode and its executor.",
        allow_abbrev=False,
    )
    _executor_option(node)
    node.add_argument(
        "--preload",
        default="florist.client.app:app",
        metavar="MODULE:APP",
        help="the ClientApp the warm executor preloads and serves warm (default: florist's)",
    )
    node.add_argument(
        "--fork-server",
        metavar="SOCKET",
        help="have the warm executor forked by this fork server (`python -m florist.deploy.forkserver`), "
        "which preloaded the same ClientApp for every SuperNode on this machine",
    )
    node.set_defaults(func=_supernode)

    cmp = sub.add_parser(
        "compare",
        help="run strategies × seeds on one scenario and write the papers' table",
        description="Run every strategy of --strategies with every seed of --seeds on one scenario, one after the "
        "other, each in OUT/<strategy>/seed<k> (a finished run with the same config is kept, an interrupted one "
        "resumes), then write OUT/compare.md (seen/unseen mean and bottom decile, mean ± std over seeds, kB and "
        "seconds per round), compare.json and compare.png.",
    )
    cmp.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated (default: all)")
    cmp.add_argument("--seeds", default="1,2,3", help="comma-separated (default: 1,2,3)")
    _scenario_options(cmp)
    cmp.add_argument("--num-clients", type=_count, default=20, help="simulated clients (default: 20)")
    cmp.add_argument("--out", required=True, help="output folder")
    cmp.add_argument(
        "--runtime",
        choices=("simulation", "in-process"),
        default="simulation",
        help="simulation: Flower's simulation runtime (Ray); in-process: the same ServerApp and "
        "ClientApp called directly, no Ray (same results, less overhead). Default: simulation",
    )
    _resource_options(cmp)
    cmp.set_defaults(func=_compare)

    store = sub.add_parser(
        "datastore",
        help="manage a node's kNN-Per datastore",
        description="A node's kNN-Per datastore lives in its state folder, beside the global model it was built "
        "with. `add` appends new local samples without retraining the global model, under the run's capacity and "
        "policy (concat: keep all; fifo: keep the newest knn-capacity; fixed: keep the first knn-capacity).",
    )
    store_sub = store.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = store_sub.add_parser(
        "add",
        help="embed a folder's labelled train samples and add them to the datastore",
        description="Embed the labelled samples of --data-dir's train split with the global model the node's "
        "datastore was built with and add them to it, under the run's knn-capacity and knn-policy. The folder's "
        "test split is never added (test points in the datastore would find themselves). No training, no "
        "connection: the node's next kNN-Per evaluation uses the new entries.",
    )
    add.add_argument(
        "--data-dir",
        required=True,
        help="a node data folder (train.npz and test.npz, or ImageFolder "
        "trees train/ and test/); only its train split is added",
    )
    add.add_argument(
        "--state-dir", help="the node's state folder (node config state-dir; default ~/.cache/florist/nodes)"
    )
    add.add_argument("--node-key", required=True, help="the node's key (node config node-key, e.g. partition-3)")
    add.set_defaults(func=_datastore_add)

    public = sub.add_parser(
        "public-hash",
        help="print the fingerprint of a PerFed-CKT public set P, for the run config",
        description="Every PerFed-CKT node must hold the same public unlabeled set P. Run this on a node's copy "
        "(public.npz with array x, or a folder of images) and put the printed line in the run config; a node "
        "whose P differs then refuses to train instead of learning from the wrong data.",
    )
    public.add_argument("public_dir", metavar="DIR", help="the folder with public.npz or the images")
    public.add_argument("--num-classes", type=int, default=10, help="label range, if public.npz has y (default: 10)")
    public.set_defaults(func=_public_hash)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Every failure a user can cause ends in one line on stderr and exit status 2 (1 for a
    bug); `--debug` or FLORIST_DEBUG=1 shows the traceback instead. Ctrl-C exits with 130."""
    # The florist command reports nothing home unless the user asks for it (their setting wins).
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "supernode":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.flower_args = extra
    debug = args.debug or os.environ.get("FLORIST_DEBUG", "") not in ("", "0")
    try:
        return args.func(args)
    except KeyboardInterrupt as stop:  # runs raise `Interrupted`, which says what was kept
        _ignore_signals()  # everything started is stopped: a late second signal must not cut the exit short
        print(f"florist: {str(stop) or 'interrupted'}", file=sys.stderr)
        return 130
    except Exception as err:
        if debug:
            raise
        if isinstance(err, (ValueError, OSError, TimeoutError, RuntimeError)):
            print(f"florist: error: {err}", file=sys.stderr)
            return 2
        print(f"florist: internal error: {type(err).__name__}: {err} (FLORIST_DEBUG=1 shows where)", file=sys.stderr)
        return 1
    finally:
        _forget_interrupt()  # also where a command caught the interrupt itself (local-federation, join)


def run() -> None:
    """The `florist` command's entry point. After a Ctrl-C, everything florist started is stopped
    and what was finished is saved, so the process ends at once: tearing down the interpreter
    with torch, pandas and pyarrow loaded took another 2.5 s, half of the time a Ctrl-C took."""
    code = main()
    if code == 130:
        with contextlib.suppress(OSError):  # a reader that has gone (`florist ... | head`)
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
