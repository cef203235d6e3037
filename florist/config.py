"""The run configuration: the settings every run has, plus the chosen algorithm's section
(`florist/strategies/<name>/spec.py`), parsed from Flower's flat kebab-case run config.

Parsing happens once, at start-up, so a typo or a wrong type fails with the key's name
instead of deep inside a round. This module knows no strategy: the registry
(`florist/apps/registry.py`) hands it each strategy's section when it is imported
(`use_sections`), and every entry point (the `florist` command, the ServerApp, the ClientApp)
imports the registry first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from florist.common import client_mods, devices, privacy, privacy_checks, scenarios
from florist.common.data import PARTITIONS, parse_partition
from florist.common.folders import parse_image_size
from florist.common.key_hints import closest_key
from florist.common.settings import NoSettings, Settings, setting

AUGMENTS = ("none", "flip", "crop-flip")  # florist/common/training.py applies them
SECURE_MODES = ("none", "secaggplus")
AGGREGATIONS = "mean | median | trimmed:BETA (0 <= BETA < 0.5) | krum:F | multikrum:F (F >= 0 Byzantine nodes)"

MAX_TORCH_THREADS = 1024  # more is a typo or an attack (a node also cuts it to its cores: client/guard.py)

# The settings section of each strategy `strategy` may name, in the registry's order (`use_sections`).
SECTIONS: dict[str, type[Settings]] = {}
# Each strategy record-level dp does not cover, with why, from its spec (`StrategySpec.record_gap`, `use_sections`).
RECORD_GAPS: dict[str, str] = {}
# The experiment trackers `trackers` may name (florist/server/tracking), each also the name of the
# package it needs: the optional `tracking` extra installs them.
TRACKERS = ("tensorboard", "mlflow", "wandb")


@dataclasses.dataclass(frozen=True)
class RunConfig(Settings):
    """What every run has. Field `foo_bar` is run-config key `foo-bar`; the chosen strategy's
    own settings are `settings` (e.g. `knn-sigmas` is `cfg.settings.sigmas` under knnper)."""

    strategy: str = setting("fedavg")
    num_server_rounds: int = setting(30)
    fraction_train: float = setting(1.0, server=True)
    min_train_nodes: int = setting(2, server=True)
    min_nodes: int = setting(2, server=True)
    node_wait_timeout: float = setting(120.0, server=True)
    round_timeout: float = setting(600.0, server=True)
    eval_every: int = setting(1, server=True)
    # data
    dataset: str = setting("digits", node=True)  # or synthetic:ALPHA,BETA, a hub id or folder (common/scenarios.py)
    partition: str = setting("dirichlet:0.3")
    shift: str = setting("none")  # or relabel:K / rotate:K: K clusters of clients, each its own labels or angle
    image_column: str = setting("")  # a Hugging Face dataset's image (or feature) column; found when empty
    label_column: str = setting("")  # ... and its label column
    image_size: str = setting("", node=True)  # H,W: each image resized to it when decoded (common/folders.py)
    # a bad image file (unreadable, truncated, another size) is left out and counted instead of stopping the run
    skip_bad_images: bool = setting(False, node=True)
    min_partition_size: int = setting(10)
    seed: int = setting(1)
    unseen_fraction: float = setting(0.2)
    val_fraction: float = setting(0.15)
    test_fraction: float = setting(0.2)
    public_size: int = setting(200)  # digits set aside as a public unlabeled set (PerFed-CKT's P)
    # model and local training
    model: str = setting("cnn")
    num_classes: int = setting(10)
    lr: float = setting(0.2)
    momentum: float = setting(0.0)
    weight_decay: float = setting(0.0)
    local_epochs: int = setting(1)
    batch_size: int = setting(16)
    augment: str = setting("none")  # none | flip | crop-flip, per batch, seeded by (seed, round, client)
    # hardware: a node's `--node-config` overrides device and torch-threads
    device: str = setting("auto", node=True)  # auto (CUDA if present, else CPU) | cpu | cuda | cuda:N | mps
    server_device: str = setting("auto", server=True)  # where server halves train their networks (PeFLL, FedAttn)
    torch_threads: int = setting(0, node=True)  # 0: the CPUs a client gets (simulation) or the node's cores
    proximal_mu: float = setting(0.0)  # FedProx's μ: μ/2·‖w − w_global‖² added to each local step's loss
    client_mods: str = setting("")  # Flower client mods around each message, by name (florist/common/client_mods.py)
    # how the server combines the nodes' models (florist/server/aggregation.py): mean (FedAvg's
    # sample-weighted mean) | median | trimmed:BETA | krum:F | multikrum:F
    aggregation: str = setting("mean", server=True)
    clip_norm: float = setting(0.0, server=True)  # clip each update's L2 distance to the global model (0: off)
    # FedAvgM's server step on the round's aggregate (florist/server/momentum.py): 0 and 1 are plain FedAvg
    server_momentum: float = setting(0.0, server=True)
    server_lr: float = setting(1.0, server=True)
    # differential privacy of the model updates (florist/common/privacy.py, docs/privacy.md): none | central
    # (the server clips and noises the sum) | local (each node clips and noises its own update) | distributed
    # (under secure aggregation: each node adds its share of central's noise before masking)
    dp: str = setting("none")
    dp_clip: float = setting(1.0)  # C: each node's update (trained minus sent model) clipped to this L2 norm
    # ε: with dp-noise-multiplier 0, the σ that spends it over num-server-rounds; else a cap the run stops at.
    # OD-PFL's descriptor noise reads the same two keys (its section declares them too)
    dp_epsilon: float = setting(math.inf)
    dp_delta: float = setting(1e-5)
    dp_noise_multiplier: float = setting(0.0)  # σ (0: calibrated from dp-epsilon)
    dp_relation: str = setting("zero-out")  # local dp's ε: zero-out | replace-one (two datasets, sensitivity 2C)
    dp_noise_seed: int = setting(0)  # 0: noise from the OS's entropy; else seeded (measurements only: docs/privacy.md)
    # `dp = "record+central"` (or +local, +distributed): user-level dp on top of record-level DP-SGD, with its own
    # budget; the dp-* keys above are then the record-level mechanism's, as under `dp = "record"`
    dp_user_epsilon: float = setting(math.inf)
    dp_user_clip: float = setting(1.0)  # C of the user-level mechanism on top: each node's update's L2 norm
    dp_user_noise_multiplier: float = setting(0.0)  # its σ (0: calibrated from dp-user-epsilon)
    # secure aggregation of the model updates (SecAgg+: docs/secure-aggregation.md): none | secaggplus (the
    # server learns only the weighted mean); the quantization range, its bits, the largest weight, the threshold
    secure_aggregation: str = setting("none")
    secagg_clip: float = setting(1.0, server=True)  # c: each weighted update value clipped to [-c, c], counted
    secagg_bits: int = setting(22, server=True)  # b: 2^b steps over [-c, c]; a round of n nodes needs n·2^b < 2^32
    secagg_max_weight: float = setting(0.0, server=True)  # W (0: the largest num-train the nodes reported)
    secagg_threshold: int = setting(0, server=True)  # t: shares that rebuild a node's secrets (0: a majority)
    # the largest reply taken from a node, in MB (0: twice what its exchange expects plus 64 MB; server/exchange.py)
    max_reply_mb: float = setting(0.0, server=True)
    max_node_examples: int = setting(0, server=True)  # cap on a node's weight, beside its discovery num-train (0: none)
    # a node key belongs to the SuperNode that first claimed it alone (its Flower node id: under
    # SuperNode auth, its registered public key), kept across resume; on with `deploy-local --auth`
    bind_node_keys: bool = setting(False, server=True)
    # evaluation: also report accuracy with the output masked to the train split's classes
    mask_classes: bool = setting(False)
    # each node keeps the model it scored with in its state folder, its last N runs' (client/personal.py)
    keep_models: int = setting(5, node=True)
    # ... under this folder (as <root>/<node key>/models/<run id>/) instead: simulate and compare put them in
    # the results folder (<results-dir>/nodes); a node that does not trust its server keeps its own choice
    models_root: str = setting("", node=True)
    # serve phase: personalize nodes that connect after training
    serve_seconds: float = setting(0.0, server=True)
    serve_count: int = setting(0, server=True)
    results_dir: str = setting("results", server=True)
    resume_from: str = setting("", server=True)  # a results folder whose run this one continues
    # where the server logs each round beside results.json: tensorboard,mlflow,wandb (empty: nowhere)
    trackers: str = setting("", server=True)
    tracking_dir: str = setting("", server=True)  # the trackers' files (empty: the results folder; compare: its own)
    # the strategy's own section; not a run-config key itself (`Settings.fields` leaves it out)
    settings: Settings = dataclasses.field(default=NoSettings(), metadata={"section": True})

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], strict: bool = False) -> RunConfig:
        """Build from `{"kebab-key": value}`: unknown keys and wrong types are refused, and
        every strategy's section checks the keys it owns, whichever strategy runs."""
        own, sections = cls._known(values)
        common = super().from_mapping({k: v for k, v in values.items() if k in own})
        for section in sections:
            section.from_mapping(values)
        return dataclasses.replace(common, settings=SECTIONS[common.strategy].from_mapping(values))

    @classmethod
    def check_types(cls, values: Mapping[str, Any]) -> None:
        """Refuse, as `from_mapping` does, an unknown key or a value of the wrong type, but run no
        value check: a node checks a server's whole config so, before its own values replace
        any of it, and must not look at the folders the server names."""
        for settings in (cls, *cls._known(values)[1]):
            settings.typed(values)

    @classmethod
    def _known(cls, values: Mapping[str, Any]) -> tuple[set[str], set[type[Settings]]]:
        """(the common keys, every strategy's section), once no key of `values` is unknown."""
        if not SECTIONS:
            raise RuntimeError("no strategy is known: import florist.apps.registry first (every entry point does)")
        own = set(cls.keys())
        sections = set(SECTIONS.values())
        known = own.union(*(s.keys() for s in sections))
        if unknown := sorted(set(values) - known):
            raise ValueError(f"unknown run-config key {unknown[0]!r}; {closest_key(unknown[0], known)}")
        return own, sections

    def to_mapping(self, travelling: bool = False) -> dict[str, Any]:
        """The kebab-case form (as in results.json); with `travelling`, what clients are sent."""
        return super().to_mapping(travelling) | self.settings.to_mapping(travelling)

    def for_node(self, node_config: Mapping[str, Any]) -> RunConfig:
        """This config with a node's `--node-config` overrides of the common settings and of the
        strategy's section applied."""
        mine = {key: node_config[key] for key in self.node_keys() if key in node_config}
        common = RunConfig.from_mapping(self.to_mapping() | mine) if mine else self
        return dataclasses.replace(common, settings=common.settings.for_node(node_config))

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with some common fields changed, validated again."""
        return RunConfig.from_mapping(self.to_mapping() | {k.replace("_", "-"): v for k, v in changes.items()})

    def checks(self) -> list[tuple[bool, str]]:
        return [
            (self.strategy in SECTIONS, f"unknown strategy {self.strategy!r}; choose one of {', '.join(SECTIONS)}"),
            (self.num_server_rounds >= 0, "num-server-rounds must be >= 0"),
            (
                self.keep_models >= 0,
                f"keep-models must be >= 0 (the runs a node keeps models of), got {self.keep_models}",
            ),
            (_parses(parse_partition, self.partition), f"partition must be {PARTITIONS}, got {self.partition!r}"),
            (not (dataset_problem := _problem(scenarios.parse_dataset, self.dataset)), dataset_problem),
            (_parses(scenarios.parse_shift, self.shift), f"shift must be {scenarios.SHIFTS}, got {self.shift!r}"),
            (not (size_problem := _problem(parse_image_size, self.image_size)), size_problem),
            (
                not self.partition.startswith("natural:") or _parses(scenarios.parse_dataset, self.dataset, "hub"),
                f"partition {self.partition!r} needs a Hugging Face dataset or folder with that column",
            ),
            (0 < self.fraction_train <= 1, "fraction-train must be in (0, 1]"),
            (self.min_train_nodes >= 1, "min-train-nodes must be >= 1"),
            (self.min_nodes >= 1, "min-nodes must be >= 1"),
            (self.eval_every >= 0, "eval-every must be >= 0 (0: evaluate only at the end)"),
            (0 <= self.unseen_fraction < 1, "unseen-fraction must be in [0, 1)"),
            (0 < self.val_fraction < 1, "val-fraction must be in (0, 1)"),
            (0 < self.test_fraction < 1, "test-fraction must be in (0, 1)"),
            (self.val_fraction + self.test_fraction < 1, "val-fraction + test-fraction must be < 1"),
            (self.public_size >= 0, "public-size must be >= 0 (0: no digits reserved for the public set)"),
            (self.lr > 0, "lr must be > 0"),
            (self.local_epochs >= 1, "local-epochs must be >= 1"),
            (self.batch_size >= 1, "batch-size must be >= 1"),
            (self.proximal_mu >= 0, "proximal-mu must be >= 0"),
            (self.augment in AUGMENTS, f"augment must be one of {', '.join(AUGMENTS)}, got {self.augment!r}"),
            (devices.parse(self.device), f"device must be {devices.FORMS}, got {self.device!r}"),
            (devices.parse(self.server_device), f"server-device must be {devices.FORMS}, got {self.server_device!r}"),
            (
                0 <= self.torch_threads <= MAX_TORCH_THREADS,
                f"torch-threads must be in [0, {MAX_TORCH_THREADS}] (0: as many as the node or client has)",
            ),
            (not (mods_problem := client_mods.problem(self.client_mods)), mods_problem),
            (
                _parses(parse_aggregation, self.aggregation),
                f"aggregation must be {AGGREGATIONS}, got {self.aggregation!r}",
            ),
            (self.clip_norm >= 0 and math.isfinite(self.clip_norm), "clip-norm must be a finite number >= 0 (0: off)"),
            (
                self.max_reply_mb >= 0 and math.isfinite(self.max_reply_mb),
                "max-reply-mb must be a finite number >= 0 (0: twice what each exchange expects plus 64 MB)",
            ),
            (self.max_node_examples >= 0, "max-node-examples must be >= 0 (0: no cap beyond num-train)"),
            (0 <= self.server_momentum < 1, f"server-momentum must be in [0, 1) (0: off), got {self.server_momentum}"),
            (0 < self.server_lr <= 10, f"server-lr must be in (0, 10] (1: FedAvg's step), got {self.server_lr}"),
            *self.privacy_checks(),
            (not (refusal := self.record_refusal()), refusal),
            *self.secure_checks(),
            (self.num_classes >= 2, "num-classes must be >= 2"),
            (self.serve_seconds >= 0 and self.serve_count >= 0, "serve-seconds and serve-count must be >= 0"),
            (self.round_timeout > 0 and self.node_wait_timeout > 0, "timeouts must be > 0"),
            (
                not self.trackers.strip() or _parses(parse_trackers, self.trackers),
                f"trackers must be comma-separated names of {', '.join(TRACKERS)}, got {self.trackers!r}",
            ),
        ]

    @property
    def record_dp(self) -> bool:
        """Whether every node trains with DP-SGD (`dp = "record"`, or `"record+…"` with user-level dp on top)."""
        return privacy.is_record(self.dp)

    @property
    def user_dp(self) -> str:
        """The user-level mechanism of the node's update (none | central | local | distributed): `dp` itself, or
        what `"record+…"` puts on top of record-level DP-SGD ("none" under `dp = "record"` alone)."""
        return privacy.user_mode(self.dp)

    def user_level(self) -> RunConfig:
        """This config as the user-level mechanism reads it: unchanged without record-level dp; under it, `dp`
        is the mechanism on top ("none" alone) and dp-epsilon, dp-clip and dp-noise-multiplier are its
        dp-user-* keys (dp-delta, dp-relation and dp-noise-seed are shared)."""
        if not self.record_dp:
            return self
        user = {"dp_epsilon": self.dp_user_epsilon, "dp_clip": self.dp_user_clip}
        return dataclasses.replace(self, dp=self.user_dp, dp_noise_multiplier=self.dp_user_noise_multiplier, **user)

    def record_refusal(self) -> str:
        """Why `dp = "record"` cannot run this strategy (its spec's `record_gap`), in one line; empty when it
        can or when the run has no record-level dp. Checked as the config is parsed, before torch is imported,
        and by the server half again (`ServerStrategy`)."""
        if not self.record_dp or self.strategy not in RECORD_GAPS:
            return ""
        return (
            f'dp = "{self.dp}": strategy {self.strategy!r} is not covered by record-level dp: '
            f"{RECORD_GAPS[self.strategy]} (docs/privacy.md)"
        )

    def privacy_checks(self) -> list[tuple[bool, str]]:
        """`dp` and its keys (florist/common/privacy_checks.py)."""
        return privacy_checks.checks(self)

    def secure_checks(self) -> list[tuple[bool, str]]:
        """`secure-aggregation` and its keys: no rule that needs each node's update, and no secagg
        key without it (which strategies it covers, their server halves say: `secured`)."""
        on = self.secure_aggregation != "none"
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name.startswith("secagg_")}
        return [
            (
                self.secure_aggregation in SECURE_MODES,
                f"secure-aggregation must be one of {', '.join(SECURE_MODES)}, got {self.secure_aggregation!r}",
            ),
            (
                not on or (self.aggregation == "mean" and self.clip_norm == 0),
                f'secure-aggregation needs aggregation = "mean" and no clip-norm: the server never sees '
                f"an update to {'clip' if self.clip_norm else self.aggregation.split(':')[0]}",
            ),
            (self.secagg_clip > 0 and math.isfinite(self.secagg_clip), "secagg-clip must be a finite number > 0"),
            (1 <= self.secagg_bits <= 30, "secagg-bits must be in [1, 30] (n nodes need n·2^bits < 2^32)"),
            (
                self.secagg_max_weight >= 0 and math.isfinite(self.secagg_max_weight),
                "secagg-max-weight must be a finite number >= 0 (0: the largest num-train)",
            ),
            (self.secagg_threshold >= 0, "secagg-threshold must be >= 0 (0: a majority of the round's nodes)"),
            (
                on or all(getattr(self, name) == value for name, value in defaults.items()),
                "secagg-clip, secagg-bits, secagg-max-weight and secagg-threshold act only with "
                'secure-aggregation = "secaggplus"',
            ),
        ]


def parse_aggregation(text: str) -> tuple[str, float]:
    """`mean` | `median` | `trimmed:β` (0 ≤ β < 0.5 cut at each end) | `krum:f` | `multikrum:f`
    (f ≥ 0 whole, the Byzantine nodes assumed) as (rule, β or f; 0 for mean and median)."""
    rule, _, arg = text.partition(":")
    if rule in ("mean", "median") and not arg:
        return rule, 0.0
    if rule == "trimmed" and arg:
        beta = float(arg)  # a ValueError when it is no number
        if 0 <= beta < 0.5:
            return rule, beta
    if rule in ("krum", "multikrum") and arg.isascii() and arg.isdigit():
        return rule, float(int(arg))
    raise ValueError(f"aggregation must be {AGGREGATIONS}, got {text!r}")


def parse_trackers(text: str) -> list[str]:
    """`"tensorboard, mlflow"` as tracker names, each once; a ValueError naming an unknown one."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if unknown := [n for n in names if n not in TRACKERS]:
        raise ValueError(f"unknown tracker {unknown[0]!r}; choose from {', '.join(TRACKERS)}")
    return names


def _parses(parse, text: str, kind: str = "") -> bool:
    """Whether `parse(text)` accepts `text` (and, given `kind`, as that kind)."""
    try:
        return parse(text)[0] == kind if kind else bool(parse(text))
    except ValueError:
        return False


def _problem(parse, text: str) -> str:
    """What `parse` says is wrong with `text` ("" when it parses): its message can be more
    precise than one naming every accepted form (a dataset folder that does not exist)."""
    try:
        parse(text)
    except ValueError as err:
        return str(err)
    return ""


def parse_overrides(text: str) -> dict[str, Any]:
    """`'k=v k2="s"'` as `flwr run --run-config` reads it: space-separated pairs, each value
    TOML (numbers, true/false, "quoted strings"). A pair that is not one is an error naming it."""
    import re
    import tomllib

    values: dict[str, Any] = {}
    for pair in re.findall(r'(?:[^\s"]|"(?:\\.|[^"\\])*")+', text):
        hint = " (separate pairs with spaces, not commas)" if "," in pair else ""
        hint = hint or (' (strings need quotes: key="text")' if re.match(r"[\w-]+=[A-Za-z]", pair) else "")
        try:
            parsed = tomllib.loads(pair) if re.match(r"[A-Za-z0-9_-]+=", pair) else None
        except tomllib.TOMLDecodeError:
            parsed = None
        if not parsed or isinstance(value := next(iter(parsed.values())), dict):
            raise ValueError(f"--run-config: {pair!r} is not key=value with a TOML value{hint}")
        values |= {next(iter(parsed)): value}
    return values


def use_sections(sections: Mapping[str, type[Settings]], record_gaps: Mapping[str, str] | None = None) -> None:
    """The strategies a run config may name, each with its settings section (the registry's), and those
    record-level dp does not cover, each with why (`record_gaps`: their specs' `record_gap`)."""
    SECTIONS.clear()
    SECTIONS.update(sections)
    RECORD_GAPS.clear()
    RECORD_GAPS.update(record_gaps or {})
