"""`florist deploy-local`: a real deployment on this machine, for one run: SuperLink and
SuperNodes as processes of their own, `flwr run`, the summary, and every process stopped."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

from florist.cli.options import (
    checked_config,
    federation_options,
    node_configs,
    print_summary,
    run_options,
    stderr_console,
)
from florist.cli.signals import interrupt_on_signals


def add(sub: argparse._SubParsersAction) -> None:
    dep = sub.add_parser(
        "deploy-local",
        help="one-shot real deployment: SuperLink + SuperNodes on 127.0.0.1, run, collect, stop",
        description="Start a SuperLink and --num-nodes SuperNodes as separate processes on 127.0.0.1 (gRPC Fleet "
        "API), submit the run with `flwr run`, stream its log, print the summary, and stop every process it started.",
    )
    run_options(dep)
    federation_options(dep)
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
    dep.set_defaults(func=run)


def message_limit_for(cfg, num_nodes: int, given_mb: float | None) -> int:
    """The SuperLink's gRPC receive limit: as given, or sized from the run's model."""
    if given_mb:
        return int(given_mb * 2**20)
    from florist.common import scenarios
    from florist.common.models import build_model
    from florist.deploy.superlink import message_limit

    model = build_model(cfg.model, scenarios.input_shape(cfg, num_nodes), cfg.num_classes)
    return message_limit(sum(t.numel() * t.element_size() for t in model.state_dict().values()))


def run(args: argparse.Namespace) -> int:
    import subprocess

    from florist.deploy.bundle import app_dir, bundle_hash
    from florist.deploy.federation import LocalFederation
    from florist.deploy.netns import Network, check_usable
    from florist.runners.simulation import Interrupted

    if args.netns:
        check_usable()  # before the run's own checks, which take seconds
    (cfg, num_nodes), console, start = checked_config(args), stderr_console(), time.monotonic()
    results_dir = Path(cfg.results_dir).expanduser().resolve()
    # The ServerApp runs in the federation's folder: paths it is given are absolute.
    absolute = {"tracking_dir": str(Path(cfg.tracking_dir).expanduser().resolve())} if cfg.tracking_dir else {}
    # Under SuperNode auth a Flower node id stands for a registered public key: bind node keys to it.
    cfg = cfg.replace(results_dir=str(results_dir), **absolute, **({"bind_node_keys": True} if args.auth else {}))
    workdir = Path(args.state_dir or results_dir / "federation").expanduser().resolve()
    results_file = results_dir / "results.json"
    app = app_dir()  # the bundle submitted below, and the only one its SuperNodes run
    interrupt_on_signals()
    try:
        # The network is made first and removed last, with whatever still runs in it.
        with (
            Network.for_federation(num_nodes) if args.netns else contextlib.nullcontext() as network,
            LocalFederation(
                workdir,
                node_configs(num_nodes, workdir),
                tls=args.tls,
                auth=args.auth,
                persistent=args.auth,  # node ids, to which node keys are bound, survive a --resume
                executor=args.executor,
                network=network,
                trust_apps=[bundle_hash(app)],
                max_message_bytes=message_limit_for(cfg, num_nodes, args.max_message_mb),
            ) as fed,
        ):
            print(f"federation up in {time.monotonic() - start:.1f} s\n{fed.describe(submit=False)}", flush=True)
            if not cfg.resume_from:
                results_file.unlink(missing_ok=True)
            rc = subprocess.run(
                fed.run_command(cfg.to_mapping(), app), env=fed.env, cwd=workdir, start_new_session=True
            ).returncode
    except KeyboardInterrupt:
        saved = json.loads(results_file.read_text()) if results_file.exists() else None
        raise Interrupted(saved, results_dir) from None
    if rc != 0 or not results_file.exists():
        raise RuntimeError(f"the run failed (flwr run exited {rc}); logs in {workdir / 'logs'}")
    print_summary(json.loads(results_file.read_text()), console, time.monotonic() - start)
    return 0
