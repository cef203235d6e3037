"""Everything about a run that can be known before it starts, checked before it starts.

`simulate`, `compare` and `deploy-local` call `configure` (the run config from the command line,
then `preflight`) first, so that a mistake costs a
second and one line naming the key or path, not a Ray start-up or a trained model that cannot
be saved. It works each thing out once (the data's layout and input shape, the model and its
size) and hands it on in a `Checked`, which the run uses instead of working it out again. What
only the nodes can know (their data folders) is checked by them (`florist join` checks its
folder before it connects).
"""

from __future__ import annotations

import dataclasses

from florist.apps.server import server_half
from florist.common import devices, scenarios
from florist.config import RunConfig
from florist.runners.launch import Events, Launch
from florist.server.checkpoint import Checkpoint, resumed_config
from florist.server.results import check_results_dir
from florist.server.tracking import check_installed


@dataclasses.dataclass(frozen=True)
class Checked:
    """A run that passed the preflight, with what the preflight worked out for it."""

    cfg: RunConfig
    num_nodes: int  # the nodes the run starts, one per partition
    layout: scenarios.Layout  # how its data lies over them, and the samples' shape
    model_bytes: int  # the model's weights and buffers: the largest array a message carries
    warnings: list[str]  # what will work badly


def preflight(cfg: RunConfig, num_nodes: int, devices_here: bool = True) -> Checked:
    """Raise ValueError naming what cannot work; return the run, checked. `devices_here`: this
    machine runs the nodes, so the run's device must be one it has (a Ray cluster's nodes have
    devices of their own)."""
    if devices_here:
        devices.resolve(cfg.device, "device")
    if num_nodes < cfg.min_nodes:
        raise ValueError(
            f"{num_nodes} clients, but min-nodes is {cfg.min_nodes}: the run would wait for nodes that never come"
        )
    layout = scenarios.layout(cfg, num_nodes)
    check_labels(cfg, layout)
    model_bytes = check_models(cfg, layout.input_shape, num_nodes - len(layout.held_out))
    check_results_dir(cfg.results_dir)
    check_installed(cfg)
    warnings = (
        run_warnings(cfg)
        + model_warnings(cfg, layout.input_shape, model_bytes)
        + partition_warnings(cfg, layout)
        + record_warnings(cfg)
    )
    return Checked(cfg, num_nodes, layout, model_bytes, warnings)


def check_labels(cfg: RunConfig, layout: scenarios.Layout) -> None:
    """The embedded partitions' labels fit `num-classes` (a folder's are checked as it is read):
    a label beyond it would stop every node in its first round."""
    top = max((int(y.max()) for y in layout.labels if len(y)), default=-1)
    if top >= cfg.num_classes:
        raise ValueError(
            f"num-classes {cfg.num_classes}, but dataset {cfg.dataset!r} has labels up to {top}: "
            f"set num-classes={top + 1} or more"
        )


def check_run(cfg: RunConfig, num_nodes: int) -> list[str]:
    """`preflight`'s warnings, its device left to be checked where the nodes run."""
    return preflight(cfg, num_nodes, devices_here=False).warnings


def run_warnings(cfg: RunConfig) -> list[str]:
    """A run of no round, or one too short for its strategy to act (its settings' `warnings`)."""
    if cfg.num_server_rounds == 0:
        return ["num-server-rounds 0: nothing trains; the clients are only scored on the initial model"]
    return cfg.settings.warnings(cfg.num_server_rounds)


# The settings recommended under `dp = "record"`, measured best on mnist5k's lenet (docs/privacy.md#record-level-dp):
# DP-SGD's noise per step is σ·dp-clip/batch-size, which drowns a small batch's gradient, and its steps want a
# larger lr and more of them than plain SGD's. Recommended, not applied: a run takes the values it is given.
RECORD_RECIPE = {"batch-size": 64, "lr": 0.1, "momentum": 0.9, "local-epochs": 3}


# FedAvg+'s fine-tuning (plain SGD, on the node) takes the run's momentum: its step is finetune-lr / (1 − momentum),
# and above this one it undid what DP-SGD trained (docs/privacy.md#record-level-dp: 76.1 % before, 68.9 after).
FINETUNE_STEP = 0.05


def record_warnings(cfg: RunConfig) -> list[str]:
    """Record-level dp at a batch smaller than the recipe's, or FedAvg+ fine-tuning its DP-trained model at a step
    the run's momentum makes 10× finetune-lr: told before the run, with what to set."""
    if not cfg.record_dp:
        return []
    warnings = []
    if cfg.batch_size < RECORD_RECIPE["batch-size"]:
        recipe = " ".join(f"{key}={value}" for key, value in RECORD_RECIPE.items())
        warnings.append(
            f'dp = "{cfg.dp}" with batch-size {cfg.batch_size}: DP-SGD\'s noise per step is σ·dp-clip/batch-size, '
            f"which drowns a small batch's gradient; try {recipe} (measured best on mnist5k's lenet: "
            "docs/privacy.md#record-level-dp)"
        )
    finetune_lr = getattr(cfg.settings, "lr", 0.0) if cfg.strategy == "fedavg-ft" else 0.0
    if finetune_lr / (1 - min(cfg.momentum, 0.999)) > FINETUNE_STEP * (1 + 1e-9) and cfg.momentum > 0:
        warnings.append(
            f"fedavg-ft fine-tunes with the run's momentum {cfg.momentum:g}: finetune-lr {finetune_lr:g} steps as "
            f"{finetune_lr / (1 - cfg.momentum):.2g}, which undoes a DP-trained model; try "
            f"finetune-lr={FINETUNE_STEP * (1 - cfg.momentum):.2g} (docs/privacy.md#record-level-dp)"
        )
    return warnings


TUNED_FOR = {"lenet": "lr=0.1 (PeFLL: hn-server-lr=1e-3)", "mobilenet_v2": "lr=0.03"}  # measured or the papers'


# A model above this is told before the run: more than MobileNetV2's 9.1 MB, the largest the
# papers' presets send (on CIFAR-10); as much again comes back, so at 10 clients a round moves
# 200 MB, some 16 s on a 100 Mbit/s link. A bound relative to the data would warn on the default
# run (its 0.3 MB cnn outweighs each of its 20 clients' digits, 41 kB at most), so it is absolute.
LARGE_MODEL_BYTES = 10_000_000


def model_warnings(cfg: RunConfig, input_shape: tuple[int, ...], model_bytes: int) -> list[str]:
    """The default step was tuned on the 8×8 `cnn`; a larger model may diverge at it. A large
    model costs its size in traffic per client per round, which a smaller model or smaller
    images would save."""
    from florist.common.models import megabytes, shape_text

    warnings = []
    default_lr = RunConfig.__dataclass_fields__["lr"].default
    if cfg.model in TUNED_FOR and cfg.lr == default_lr:
        warnings.append(
            f"lr {default_lr} is tuned for the 8×8 cnn; with model {cfg.model!r} it can diverge "
            f"(try {TUNED_FOR[cfg.model]}, or a paper preset: florist compare --preset)"
        )
    if model_bytes > LARGE_MODEL_BYTES:
        warnings.append(
            f"model {cfg.model!r} on {shape_text(input_shape)} inputs is {megabytes(model_bytes)} of weights, which "
            "each client receives and returns every round (PerFed-CKT's clients send soft decisions instead): "
            "a smaller model or image-size sends less"
        )
    return warnings


def check_models(cfg: RunConfig, input_shape: tuple[int, ...], num_seen: int) -> int:
    """The run's model accepts `input_shape`, and the strategy's server half accepts the run
    (e.g. PeFLL's hypernetwork generates no BatchNorm buffers, PerFed-CKT's client models fit
    the data); returns the model's size in bytes. The server half is built here once, dry (no
    exchanger): its checks are made by its constructor as it builds what they are about (the
    hypernetwork, the attention over the biases, the client models, the robust rule, the server
    device), so building it is the strategy's own check, one that cannot drift from the run's."""
    from florist.common.models import build_model

    model = build_model(cfg.model, input_shape, cfg.num_classes)
    server_half(cfg.strategy)(cfg, None, input_shape, num_seen)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


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


def configure(launch: Launch, events: Events, devices_here: bool = True) -> Checked:
    """The launch's run config and node count, refused before any work starts if anything about
    them cannot work (`preflight`), its doubts told to `events`."""
    checked = preflight(*run_config(launch), devices_here)
    for warning in checked.warnings:
        events.warning(warning)
    return checked


def run_config(launch: Launch) -> tuple[RunConfig, int]:
    """The run config from the launch's values and the node count; with `resume`, the resumed
    run's own, which any value given beside must agree with."""
    if not launch.resume:
        num_nodes = launch.num_nodes or launch.default_nodes
        values = {"min-nodes": num_nodes} | dict(launch.values)
        return with_classes(RunConfig.from_mapping(values), "num-classes" in values, num_nodes), num_nodes
    num_nodes = len(Checkpoint.load(launch.resume).nodes)
    if launch.num_nodes not in (None, num_nodes):
        raise ValueError(f"cannot resume from {launch.resume}: its run had {num_nodes} nodes, not {launch.num_nodes}")
    return resumed_config(launch.resume, launch.values), num_nodes


def with_classes(cfg: RunConfig, given: bool, num_nodes: int) -> RunConfig:
    """`cfg` with `num-classes` from the dataset's class names (an image folder: its class
    sub-folders) when the user did not give one; one given that is too small is refused in one
    line. Before the data is decoded: its cache is keyed by num-classes."""
    if scenarios.parse_dataset(cfg.dataset)[0] != "hub":  # the embedded and synthetic data's classes are fixed
        return cfg
    from florist.common.hub import class_count

    found = class_count(cfg, num_nodes)
    if found is None or found == cfg.num_classes:
        return cfg
    if not given:
        return cfg.replace(num_classes=found)
    if found > cfg.num_classes:
        raise ValueError(
            f"num-classes {cfg.num_classes}, but dataset {cfg.dataset!r} names {found} classes (a folder: its "
            f"class sub-folders): set num-classes={found}, or leave it out"
        )
    return cfg
