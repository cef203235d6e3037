"""A federation on this machine: a SuperLink and SuperNodes as processes of their own, one
partition each, for `deploy-local`'s run (`runners/deployment.py`) or, with `local-federation`,
kept up for `flwr run` to submit runs to until Ctrl-C."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from florist.deploy.bundle import TrustedApps, bundle_hash
from florist.deploy.federation import LocalFederation
from florist.runners.launch import Events, Federation


def node_configs(num_nodes: int, state_root: Path) -> list[dict[str, Any]]:
    """The node config of each of `num_nodes` SuperNodes, partition i of them each."""
    return [
        {
            "partition-id": i,
            "num-partitions": num_nodes,
            "node-key": f"partition-{i}",
            "state-dir": str(state_root / "node-state"),
        }
        for i in range(num_nodes)
    ]


def serve(federation: Federation, num_nodes: int, events: Events) -> str | None:
    """A federation of `num_nodes` SuperNodes kept up for `flwr run` to submit runs to, until
    Ctrl-C (None) or until its SuperLink exits by itself (its log's last lines). Its SuperNodes
    run the checkout's bundle as it is now (what `flwr run .` submits) and any other trusted."""
    workdir = Path(federation.state_dir or ".").expanduser().resolve()
    trusted = sorted(TrustedApps.parse([bundle_hash(), *federation.trust_apps]).hashes)
    events.started(0, 0)
    given_mb = federation.max_message_mb
    with LocalFederation(
        workdir,
        node_configs(num_nodes, workdir),
        tls=federation.tls,
        auth=federation.auth,
        executor=federation.executor,
        persistent=federation.persistent,
        trust_apps=trusted,
        max_message_bytes=given_mb and int(given_mb * 2**20),
    ) as fed:
        events.federation(fed.describe())
        try:
            while fed.superlink.alive():
                fed.ensure_runs_served()
                time.sleep(1)
            return fed.superlink.tail()
        except KeyboardInterrupt:
            events.stopping()
    return None
