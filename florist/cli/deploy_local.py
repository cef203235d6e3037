"""`florist deploy-local`: a real deployment on this machine, for one run: SuperLink and
SuperNodes as processes of their own, `flwr run`, the summary, and every process stopped."""

from __future__ import annotations

import argparse

from florist.cli.display import Display, print_summary, stderr_console
from florist.cli.options import federation, federation_options, launch, path, run_options


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
        type=path,
        help="federation folder: database, certificates, keys, logs, node state (default: RESULTS_DIR/federation)",
    )
    dep.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    asked = launch(args)  # a run config that cannot work is refused here, before torch is imported

    from florist.runners.deployment import deploy_local  # it imports torch and flwr

    display = FederationDisplay()
    results = deploy_local(asked, federation(args), display)
    print_summary(results, stderr_console(), display.wall(), table=False)  # the streamed log ends with the table
    return 0


class FederationDisplay(Display):
    """How long the federation took to come up, and where it is."""

    def federation(self, description: str) -> None:
        print(f"federation up in {self.wall():.1f} s\n{description}", flush=True)
