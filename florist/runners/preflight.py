"""Everything about a run that can be known before it starts, checked before it starts.

`simulate`, `deploy-local` and the ServerApp call `check_run` first, so that a mistake costs
a second and one line naming the key or path, not a Ray start-up or a trained model that
cannot be saved. What only the nodes can know (their data folders) is checked by them
(`florist join` checks its folder before it connects).
"""

from __future__ import annotations

from florist.common import data, scenarios
from florist.common.config import RunConfig
from florist.server.results import check_results_dir
from florist.strategies import strategy_spec


def check_run(cfg: RunConfig, num_clients: int | None = None, input_shape: tuple[int, ...] | None = None) -> list[str]:
    """Raise ValueError naming what cannot work; return warnings about what will work badly.
    `num_clients`: the embedded partitions' count, when the run uses them; `input_shape`: the
    nodes' samples' (by default the embedded dataset's)."""
    input_shape = input_shape or scenarios.input_shape(cfg, num_clients or cfg.min_nodes)
    if num_clients is not None and num_clients < cfg.min_nodes:
        raise ValueError(
            f"{num_clients} clients, but min-nodes is {cfg.min_nodes}: the run would wait for nodes that never come"
        )
    num_seen = num_clients - len(held_out(cfg, num_clients)) if num_clients else max(cfg.min_train_nodes, 1)
    check_models(cfg, input_shape, num_seen)
    check_results_dir(cfg.results_dir)
    embedded = cfg.dataset in data.EMBEDDED_SHAPES
    return partition_warnings(cfg, num_clients) if num_clients and embedded else []


def held_out(cfg: RunConfig, num_clients: int) -> frozenset[int]:
    return data.unseen_partitions(num_clients, cfg.unseen_fraction, cfg.seed)


def check_models(cfg: RunConfig, input_shape: tuple[int, ...], num_seen: int) -> None:
    """The run's model accepts `input_shape`, and the strategy's server half accepts the run
    (e.g. PeFLL's hypernetwork generates no BatchNorm buffers, PerFed-CKT's client models fit
    the data): the server half is built here once, dry, so its own checks speak now."""
    from florist.common.models import build_model

    build_model(cfg.model, input_shape, cfg.num_classes)
    strategy_spec(cfg.strategy).server()(cfg, None, input_shape, num_seen)


def partition_warnings(cfg: RunConfig, num_clients: int) -> list[str]:
    """Builds the embedded partitions (as the clients will; a ValueError if they cannot be
    built) and warns about classes that only held-out clients have: no training client ever
    sees them, so those clients score 0 on them whatever the strategy."""
    parts = data.partition_indices(
        cfg.partition, num_clients, cfg.seed, cfg.min_partition_size, cfg.public_size, cfg.dataset
    )
    labels = data.load_embedded(cfg.dataset)[1]
    unseen = held_out(cfg, num_clients)
    trained = set().union(*(set(labels[p].tolist()) for i, p in enumerate(parts) if i not in unseen))
    warnings = []
    for label in sorted(set(labels.tolist()) - trained):
        owners = [i for i in sorted(unseen) if label in set(labels[parts[i]].tolist())]
        warnings.append(
            f"digit {label} belongs only to held-out client(s) {', '.join(map(str, owners))}: no training "
            f"client has it, so they cannot be right on it (partition {cfg.partition!r}, "
            f"unseen-fraction {cfg.unseen_fraction})"
        )
    return warnings
