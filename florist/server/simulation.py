"""Run florist in Flower's simulation runtime, in this process (Ray runs the clients)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from florist.common.config import RunConfig


class _DropDeprecation(logging.Filter):
    """`run_simulation` warns that it is deprecated in favour of `flwr run`; florist offers
    both (see the README), so the warning says nothing actionable to a florist user."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "run_simulation" not in record.getMessage()


@contextlib.contextmanager
def _without_deprecation_warning() -> Iterator[None]:
    from flwr.common.logger import FLOWER_LOGGER

    drop = _DropDeprecation()
    FLOWER_LOGGER.addFilter(drop)
    try:
        yield
    finally:
        FLOWER_LOGGER.removeFilter(drop)


def simulate(cfg: RunConfig, num_clients: int, on_round=None, client_app=None) -> dict[str, Any]:
    """Run `cfg` on `num_clients` simulated SuperNodes; return the parsed results.json."""
    from flwr.simulation import run_simulation

    from florist.client.app import app as default_client_app
    from florist.server.app import make_server_app

    if num_clients < cfg.min_nodes:
        raise ValueError(f"num-clients ({num_clients}) must be at least min-nodes ({cfg.min_nodes})")
    with _without_deprecation_warning():
        run_simulation(
            server_app=make_server_app(cfg.to_mapping(), on_round),
            client_app=client_app or default_client_app,
            num_supernodes=num_clients,
            backend_config={
                "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                "init_args": {"num_cpus": os.cpu_count() or 1, "logging_level": "ERROR", "log_to_driver": False},
            },
        )
    return json.loads((Path(cfg.results_dir).expanduser() / "results.json").read_text())
