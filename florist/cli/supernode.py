"""`florist supernode`: Flower's SuperNode with florist's fast path (every option of
`flower-supernode` passes through: `main` hands the ones it does not know on)."""

from __future__ import annotations

import argparse

from florist.cli.options import executor_option, path

TRUST_APP_HELP = (
    "run only this app bundle (its sha256, printed by `florist app-hash DIR` where DIR is what `flwr run` "
    "submits; repeatable): any other is refused before it is fetched, and the server gets an error reply. "
    "Without it, this box runs any app the SuperLink sends"
)


def trust_app_option(parser: argparse.ArgumentParser, help: str = TRUST_APP_HELP) -> None:
    parser.add_argument("--trust-app", action="append", default=[], metavar="SHA256", help=help)


def add(sub: argparse._SubParsersAction) -> None:
    node = sub.add_parser(
        "supernode",
        help="run a Flower SuperNode with florist's fast path (flower-supernode's options, plus --executor, "
        "--trust-app)",
        description="Flower's SuperNode (every option of `flower-supernode --help` is accepted and passed on) with "
        "florist's deployment fast path: polling that is quick while messages flow, and with --executor warm a "
        "warm executor that runs florist's ClientApp in a forked child per message instead of a new Python "
        "process. Runs in the foreground; Ctrl-C or SIGTERM stops the SuperNode and its executor.",
        allow_abbrev=False,
    )
    executor_option(node)
    node.add_argument(
        "--preload",
        default="florist.apps.client:app",
        metavar="MODULE:APP",
        help="the ClientApp the warm executor preloads and serves warm (default: florist's)",
    )
    node.add_argument(
        "--fork-server",
        metavar="SOCKET",
        help="have the warm executor forked by this fork server (`python -m florist.deploy.forkserver`), "
        "which preloaded the same ClientApp for every SuperNode on this machine",
    )
    node.add_argument(
        "--app-dir",
        type=path,
        metavar="DIR",
        help="where florist is installed as a package (not run from a checkout): a folder with the files its app "
        "bundle is built from (pyproject.toml, README.md, florist/); a run of that exact bundle is served warm",
    )
    trust_app_option(node)
    node.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from florist.deploy import supernode

    supernode.run(args.executor, args.flower_args, args.preload, args.fork_server, args.app_dir, args.trust_app)
    return 0
