"""Everything about a run that can be known before it starts, checked before it starts.

`simulate`, `compare` and `deploy-local` call `check_run` first, so that a mistake costs a
second and one line naming the key or path, not a Ray start-up or a trained model that cannot
be saved. What only the nodes can know (their data folders) is checked by them (`florist join`
checks its folder before it connects).
"""

from __future__ import annotations

from florist.common import scenarios
from florist.config import RunConfig
from florist.server.results import check_results_dir
from florist.server.tracking import check_installed
from florist.strategies import strategy_spec


def check_run(cfg: RunConfig, num_clients: int) -> list[str]:
    """Raise ValueError naming what cannot work; return warnings about what will work badly.
    `num_clients`: the nodes the run starts, one per partition."""
    if num_clients < cfg.min_nodes:
        raise ValueError(
            f"{num_clients} clients, but min-nodes is {cfg.min_nodes}: the run would wait for nodes that never come"
        )
    layout = scenarios.layout(cfg, num_clients)
    check_models(cfg, layout.input_shape, num_clients - len(layout.held_out))
    check_results_dir(cfg.results_dir)
    check_installed(cfg)
    return run_warnings(cfg) + model_warnings(cfg) + partition_warnings(cfg, layout)


def run_warnings(cfg: RunConfig) -> list[str]:
    """A run of no round, or one too short for its strategy to act (its settings' `warnings`)."""
    if cfg.num_server_rounds == 0:
        return ["num-server-rounds 0: nothing trains; the clients are only scored on the initial model"]
    return cfg.settings.warnings(cfg.num_server_rounds)


TUNED_FOR = {"lenet": "lr=0.1 (PeFLL: hn-server-lr=1e-3)", "mobilenet_v2": "lr=0.03"}  # measured or the papers'


def model_warnings(cfg: RunConfig) -> list[str]:
    """The default step was tuned on the 8×8 `cnn`; a larger model may diverge at it."""
    default_lr = RunConfig.__dataclass_fields__["lr"].default
    if cfg.model in TUNED_FOR and cfg.lr == default_lr:
        return [
            f"lr {default_lr} is tuned for the 8×8 cnn; with model {cfg.model!r} it can diverge "
            f"(try {TUNED_FOR[cfg.model]}, or a paper preset: florist compare --preset)"
        ]
    return []


def check_models(cfg: RunConfig, input_shape: tuple[int, ...], num_seen: int) -> None:
    """The run's model accepts `input_shape`, and the strategy's server half accepts the run
    (e.g. PeFLL's hypernetwork generates no BatchNorm buffers, PerFed-CKT's client models fit
    the data): the server half is built here once, dry, so its own checks speak now."""
    from florist.common.models import build_model

    build_model(cfg.model, input_shape, cfg.num_classes)
    strategy_spec(cfg.strategy).server()(cfg, None, input_shape, num_seen)


def partition_warnings(cfg: RunConfig, layout: scenarios.Layout) -> list[str]:
    """Classes that only held-out clients have: no training client ever sees them, so those
    clients score 0 on them whatever the strategy."""
    trained = set().union(*(set(y.tolist()) for i, y in enumerate(layout.labels) if i not in layout.held_out))
    everyone = set().union(*(set(y.tolist()) for y in layout.labels))
    warnings = []
    for label in sorted(everyone - trained):
        owners = [i for i in sorted(layout.held_out) if label in set(layout.labels[i].tolist())]
        warnings.append(
            f"digit {label} belongs only to held-out client(s) {', '.join(map(str, owners))}: no training "
            f"client has it, so they cannot be right on it (partition {cfg.partition!r}, "
            f"unseen-fraction {cfg.unseen_fraction})"
        )
    return warnings
