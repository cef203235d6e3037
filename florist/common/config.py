"""The run configuration: one typed object parsed from Flower's kebab-case run config.

Parsing happens once, at start-up, so a typo or a wrong type fails with the key's name
instead of deep inside a round.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

# The strategies `strategy` may name (their server halves are in florist.strategies; kept here,
# without importing them, so that checking a config needs no torch).
STRATEGY_NAMES = ("fedavg", "fedavg-ft", "local", "knnper", "pefll", "odpfl", "perfed-ckt", "fedattn")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every knob of a run. Field `foo_bar` is run-config key `foo-bar`."""

    strategy: str = "fedavg"
    num_server_rounds: int = 30
    fraction_train: float = 1.0
    min_train_nodes: int = 2
    min_nodes: int = 2
    node_wait_timeout: float = 120.0
    round_timeout: float = 600.0
    eval_every: int = 1
    # data (the clients read these from every message)
    partition: str = "dirichlet:0.3"
    min_partition_size: int = 10
    seed: int = 1
    unseen_fraction: float = 0.2
    val_fraction: float = 0.15
    test_fraction: float = 0.2
    # model and local training
    model: str = "cnn"
    num_classes: int = 10
    lr: float = 0.2
    momentum: float = 0.0
    weight_decay: float = 0.0
    local_epochs: int = 1
    batch_size: int = 16
    finetune_epochs: int = 5
    finetune_lr: float = 0.05
    # kNN-Per
    knn_sigma: float = 1.0
    knn_ks: str = "5,10"
    knn_index: str = "flat"
    knn_capacity: int = 0
    knn_policy: str = "concat"
    # hypernetwork strategies (pefll, odpfl)
    hn_embed_dim: int = 0
    hn_batch: int = 32
    hn_local_steps: int = 50
    hn_hidden: int = 100
    hn_optimizer: str = "adam"
    hn_server_lr: float = 1e-3
    hn_l2_hyper: float = 1e-3
    hn_l2_embed: float = 1e-3
    hn_l2_model: float = 5e-5
    # OD-PFL: descriptors of unlabeled data, Gaussian noise for nodes being served
    odpfl_encode_batch: int = 256
    dp_epsilon: float = math.inf
    dp_delta: float = 1e-5
    # PerFed-CKT: the public unlabeled set P, per-client architectures, clustered distillation
    public_size: int = 200
    public_dir: str = ""
    public_hash: str = ""
    client_models: str = ""
    ckt_clusters: int = 3
    ckt_lambda: float = 0.01
    ckt_steps: int = 50
    ckt_soft: str = "logits"
    # FedAttn: attention over the nearest clients' biases, and what keeps it stable
    fedattn_k: int = 5
    fedattn_key_dim: int = 16
    fedattn_lr: float = 1e-3
    fedattn_warmup: int = 5
    fedattn_clip: float = 1.0
    fedattn_reg: float = 0.1
    fedattn_residual: bool = True
    # evaluation: also report accuracy with the output masked to the train split's classes
    mask_classes: bool = False
    # serve phase: personalize nodes that connect after training
    serve_seconds: float = 0.0
    serve_count: int = 0
    results_dir: str = "results"

    @property
    def knn_k_grid(self) -> tuple[int, ...]:
        """`knn-ks` ("5,10") as integers."""
        return tuple(int(k) for k in self.knn_ks.split(","))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RunConfig:
        """Build from `{"kebab-key": value}`, rejecting unknown keys and wrong types."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in fields:
                known = ", ".join(sorted(f.replace("_", "-") for f in fields))
                raise ValueError(f"unknown run-config key {key!r}; known keys: {known}")
            kwargs[name] = _coerce(key, value, type(getattr(cls, name)))
        config = cls(**kwargs)
        config.validate()
        return config

    def to_mapping(self) -> dict[str, Any]:
        """The kebab-case form, as written to results.json and sent to clients."""
        return {k.replace("_", "-"): v for k, v in dataclasses.asdict(self).items()}

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with some fields changed, validated again."""
        config = dataclasses.replace(self, **changes)
        config.validate()
        return config

    def validate(self) -> None:
        """Reject values that cannot work, naming the key."""
        checks = [
            (self.strategy in STRATEGY_NAMES, f"strategy must be one of {', '.join(STRATEGY_NAMES)}"),
            (self.num_server_rounds >= 0, "num-server-rounds must be >= 0"),
            (0 < self.fraction_train <= 1, "fraction-train must be in (0, 1]"),
            (self.min_train_nodes >= 1, "min-train-nodes must be >= 1"),
            (self.min_nodes >= 1, "min-nodes must be >= 1"),
            (self.eval_every >= 0, "eval-every must be >= 0 (0: evaluate only at the end)"),
            (0 <= self.unseen_fraction < 1, "unseen-fraction must be in [0, 1)"),
            (0 < self.val_fraction < 1, "val-fraction must be in (0, 1)"),
            (0 < self.test_fraction < 1, "test-fraction must be in (0, 1)"),
            (self.val_fraction + self.test_fraction < 1, "val-fraction + test-fraction must be < 1"),
            (self.lr > 0 and self.finetune_lr > 0, "lr and finetune-lr must be > 0"),
            (self.local_epochs >= 1, "local-epochs must be >= 1"),
            (self.finetune_epochs >= 0, "finetune-epochs must be >= 0"),
            (self.batch_size >= 1, "batch-size must be >= 1"),
            (self.num_classes >= 2, "num-classes must be >= 2"),
            (self.knn_sigma > 0, "knn-sigma must be > 0"),
            (all(p.strip().isdigit() and int(p) >= 1 for p in self.knn_ks.split(",")),
             "knn-ks must list positive integers, e.g. \"5,10\""),
            (self.knn_index in ("flat", "hnsw", "ivf"), "knn-index must be flat, hnsw or ivf"),
            (self.knn_policy in ("concat", "fifo", "fixed"), "knn-policy must be concat, fifo or fixed"),
            (self.knn_policy == "concat" or self.knn_capacity >= 1, "knn-policy fifo/fixed needs knn-capacity >= 1"),
            (self.hn_embed_dim >= 0, "hn-embed-dim must be >= 0 (0: 1 + n/4)"),
            (min(self.hn_batch, self.hn_local_steps, self.hn_hidden) >= 1,
             "hn-batch, hn-local-steps and hn-hidden must be >= 1"),
            (self.hn_optimizer in ("sgd", "adam"), "hn-optimizer must be sgd or adam"),
            (self.hn_server_lr > 0, "hn-server-lr must be > 0"),
            (min(self.hn_l2_hyper, self.hn_l2_embed, self.hn_l2_model) >= 0, "hn-l2-* must be >= 0"),
            (self.odpfl_encode_batch >= 1, "odpfl-encode-batch must be >= 1"),
            (self.dp_epsilon > 0, "dp-epsilon must be > 0 (inf: no noise)"),
            (0 < self.dp_delta < 1, "dp-delta must be in (0, 1)"),
            (self.public_size >= 0, "public-size must be >= 0 (0: no digits reserved for the public set)"),
            (all(self.client_models.split(",")) or not self.client_models,
             "client-models must list model names separated by commas, e.g. \"cnn,mlp,cnn-wide\""),
            (self.ckt_clusters >= 1, "ckt-clusters must be >= 1"),
            (self.ckt_lambda >= 0, "ckt-lambda must be >= 0"),
            (self.ckt_soft in ("logits", "probs"), "ckt-soft must be logits or probs"),
            (self.ckt_steps >= 0, "ckt-steps must be >= 0 (0: local-epochs passes over the train split)"),
            (self.fedattn_k >= 1 and self.fedattn_key_dim >= 1, "fedattn-k and fedattn-key-dim must be >= 1"),
            (self.fedattn_lr > 0, "fedattn-lr must be > 0"),
            (min(self.fedattn_warmup, self.fedattn_clip, self.fedattn_reg) >= 0,
             "fedattn-warmup, fedattn-clip and fedattn-reg must be >= 0 (0: off)"),
            (self.serve_seconds >= 0 and self.serve_count >= 0, "serve-seconds and serve-count must be >= 0"),
            (self.round_timeout > 0 and self.node_wait_timeout > 0, "timeouts must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid run config: {message}")


def _coerce(key: str, value: Any, kind: type) -> Any:
    """Accept ints for floats (TOML `1` vs `1.0`), nothing else implicit."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(
            f"run-config key {key!r} expects {kind.__name__}, got {value!r} ({type(value).__name__})"
        )
    return value


def parse_overrides(text: str) -> dict[str, Any]:
    """Parse `'k=v k2="s"'` exactly as `flwr run --run-config` does (values are TOML)."""
    from flwr.common.config import parse_config_args

    return dict(parse_config_args([text])) if text.strip() else {}
