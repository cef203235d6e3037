"""florist's ServerApp (`[tool.flwr.app.components] serverapp`): the run config parsed, then the
run (`florist/server/loop.py`) driven by the chosen strategy's server half, from this table."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

import florist
from florist import USER_ERRORS
from florist.apps.registry import STRATEGIES
from florist.config import RunConfig
from florist.server import loop
from florist.server.loop import RoundCallback
from florist.server.results import Results, check_results_dir, note_error
from florist.server.strategy import ServerStrategy
from florist.server.tracking import check_installed
from florist.strategies.fedattn.server import FedAttn
from florist.strategies.fedavg.server import FedAvg
from florist.strategies.knnper.server import KnnPer
from florist.strategies.local.server import Local
from florist.strategies.pefll.server import ODPFL, PeFLL
from florist.strategies.perfedckt.server import PerFedCKT

PACKAGE = Path(florist.__file__).parent
SERVER_HALVES: dict[str, type[ServerStrategy]] = {
    "fedavg": FedAvg,
    "fedavg-ft": FedAvg,  # the same rounds: its clients fine-tune before they test
    "local": Local,
    "knnper": KnnPer,
    "pefll": PeFLL,
    "odpfl": ODPFL,
    "perfed-ckt": PerFedCKT,
    "fedattn": FedAttn,
}
if sorted(SERVER_HALVES) != sorted(STRATEGIES):
    raise ValueError(f"florist/apps/server.py pairs {sorted(SERVER_HALVES)}, the registry lists {sorted(STRATEGIES)}")


def server_half(name: str) -> type[ServerStrategy]:
    """The server half of strategy `name`."""
    if name not in SERVER_HALVES:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(SERVER_HALVES)}")
    return SERVER_HALVES[name]


def run(grid: Grid, cfg: RunConfig, on_round: RoundCallback | None = None, run_id: int = 0) -> Results:
    """The whole run of `cfg` on `grid`, by its strategy's server half (`loop.run`); a run that
    stops says why in its results.json too (`error`: deploy-local reads it there)."""
    try:
        return loop.run(grid, cfg, server_half(cfg.strategy), on_round, run_id)
    except Exception as err:  # a stop florist explains in one line, or anything else that ended the run
        note_error(cfg.results_dir, str(err) or type(err).__name__)
        raise


class OneLineStops(logging.Filter):
    """Flower logs the exception that ended a ServerApp with its traceback; a stop florist explains
    (one of `florist.USER_ERRORS` raised by florist's own code: a round too few nodes answered, a
    budget, a refused setting) is logged as its one line instead, as the `florist` command prints
    it. One raised inside torch, numpy or Flower is a bug to find and keeps its traceback, as does
    every stop under FLORIST_DEBUG=1."""

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        if isinstance(err, USER_ERRORS) and raised_here(err) and os.environ.get("FLORIST_DEBUG", "") in ("", "0"):
            record.msg, record.args, record.exc_info, record.exc_text = "florist: error: %s", (err,), None, None
        return True


def raised_here(err: BaseException) -> bool:
    """Whether `err` was raised in florist's own code (the innermost frame of its traceback)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).is_relative_to(PACKAGE)


def quiet_tracebacks() -> None:
    """Put `OneLineStops` on Flower's logger, once per process."""
    flower = logging.getLogger("flwr")
    if not any(isinstance(f, OneLineStops) for f in flower.filters):
        flower.addFilter(OneLineStops())


def make_server_app(overrides: Mapping[str, Any] | None = None, on_round: RoundCallback | None = None) -> ServerApp:
    """A ServerApp whose run config is the app's run config with `overrides` on top (the
    simulation API passes no run config, so `florist simulate` passes it this way)."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        quiet_tracebacks()
        cfg = RunConfig.from_mapping({**context.run_config, **(overrides or {})})
        check_results_dir(cfg.results_dir)  # before any work: a run that cannot be saved is not started
        check_installed(cfg)  # ... nor one whose trackers are missing (`florist` commands refuse it earlier)
        run(grid, cfg, on_round, context.run_id)

    return server_app


app = make_server_app()
