"""How many turns a reader takes following a run from `florist simulate` to the first `train`
handler: every call into florist that is handed the run config (the CLI's arguments, a
`Launch` made of them, or a `RunConfig`), in order, until a strategy's client `train` starts.

A "stop" is a call from one file into another, to a function not read before; the figures
are the stops, the files entered, the returns to a file already visited, and the stops that go
back up the layers (tests/test_layout.py's: common < config < client, server < strategies <
apps < runners, deploy < cli). The run uses Ray in `florist simulate`, where the handler runs in
another process; here the simulation runner is stood in for by the in-process runtime (the
same ServerApp loop and ClientApp, one process), so the whole path is in one trace. Works on
any florist checkout (`PYTHONPATH=CHECKOUT`).

    python benchmarks/walk.py [--list] [--every-call]

`--every-call` follows every call between florist's files (a function read once is not
counted again), whatever it is handed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from pathlib import Path

# tests/test_layout.py's layers; the same table for every checkout, so that figures compare.
LAYERS = {
    "common": 0,
    "config": 1,
    "client": 2,
    "server": 2,
    "strategies": 3,
    "algorithms": 3,
    "apps": 4,
    "runners": 5,
    "deploy": 5,
    "cli": 6,
}


def layer(path: str) -> int:
    part = path.split("/")[1] if "/" in path else path.removesuffix(".py")
    return LAYERS.get(part, LAYERS["cli"] if part.startswith("cli") else 0)


def stand_in_for_ray() -> None:
    """`simulate_in_child` runs the in-process runtime instead (old and new module paths)."""
    for name in ("florist.runners.simulation", "florist.server.simulation"):
        try:
            simulation = importlib.import_module(name)
        except ImportError:
            continue
        inprocess = importlib.import_module(name.replace("simulation", "inprocess"))
        simulation.simulate_in_child = lambda cfg, n, on_round=None, *rest, **kw: inprocess.run_in_process(cfg, n)
        return
    raise SystemExit("no florist simulation runner found on the path")


def trace(argv: list[str], every_call: bool) -> list[tuple[str, str]]:
    """(file under florist/, function) of every call from another file that is handed the run
    config (with `every_call`: every call from another file), until `train`."""
    try:
        from florist.config import RunConfig
    except ImportError:  # a checkout from before the run config left common/
        from florist.common.config import RunConfig

    root = str(Path(importlib.import_module("florist").__file__).parent.parent) + os.sep
    calls: list[tuple[str, str]] = []

    class Found(Exception):
        pass

    def profile(frame, event, _arg):
        if event != "call" or not frame.f_code.co_filename.startswith(root + "florist"):
            return
        if frame.f_code.co_name == "<module>":  # an import, not a call a reader follows
            return
        code, path = frame.f_code, frame.f_code.co_filename[len(root) :]
        if code.co_name == "train" and path.endswith("client.py"):
            calls.append((path, code.co_name))
            sys.setprofile(None)
            raise Found
        arguments = [frame.f_locals.get(n) for n in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]]
        caller = frame.f_back.f_code.co_filename if frame.f_back else ""
        # a `Launch` (runners/launch.py) carries a command's parsed flags to its runner
        handed = every_call or any(
            isinstance(a, (RunConfig, argparse.Namespace)) or type(a).__name__ == "Launch" for a in arguments
        )
        if caller != code.co_filename and handed:
            calls.append((path, code.co_name))

    from florist.cli import main

    stand_in_for_ray()
    sys.setprofile(profile)
    try:
        main(argv)
    except Found:
        pass
    finally:
        sys.setprofile(None)
    return calls


def summarize(calls: list[tuple[str, str]]) -> dict[str, object]:
    """A function read once is not read again (each node's ClientApp calls the same ones)."""
    stops, visited, returns, up = [calls[0]], {calls[0][0]}, 0, 0
    for path, name in calls[1:]:
        if (path, name) in stops:
            continue
        returns += path in visited
        up += layer(path) > layer(stops[-1][0])
        visited.add(path)
        stops.append((path, name))
    return {"stops": stops, "files": len(visited), "returns": returns, "up": up}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print every stop")
    parser.add_argument("--every-call", action="store_true", help="follow every call between files")
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="florist-walk-")
    argv = ["simulate", "--num-clients", "3", "--rounds", "1", "--results-dir", out]
    walk = summarize(trace(argv, args.every_call))
    if args.list:
        for i, (path, name) in enumerate(walk["stops"], 1):
            print(f"{i:3d}  {path}:{name}")
    print(
        f"florist simulate -> first train handler, {'every call' if args.every_call else 'calls handed the run config'}"
        f": {len(walk['stops'])} stops in {walk['files']} files, {walk['returns']} returns to a file already "
        f"visited, {walk['up']} back up the layers"
    )


if __name__ == "__main__":
    main()
