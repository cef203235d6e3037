"""What travels between server and clients: message types, record keys, and the checks on
what arrives. Record layout follows Flower's convention so that Flower's own strategies can
drive florist clients: model under `arrays`, settings under `config`, numbers under `metrics`
(with `num-examples`)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.serde import recorddict_to_proto

ARRAYS, CONFIG, METRICS = "arrays", "config", "metrics"
SIDE = "side"  # arrays sent beside the model (FedAttn: representation, bias gradient)
TIMING = "timing"  # ConfigRecord of every florist reply: `handler-seconds`, the handler's own time

# Message types are declared by the algorithms' specs (florist/algorithms/<name>/spec.py).


class ProtocolError(ValueError):
    """A reply or request that does not have the expected content."""


def to_record(model: torch.nn.Module) -> ArrayRecord:
    return ArrayRecord(model.state_dict())


def state_of(record: ArrayRecord, reference: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Tensors of `record`, checked against `reference` (same keys, shapes, finite values).

    `source` names where the record came from (a node, a file) for the error message.
    """
    state = record.to_torch_state_dict()
    missing, extra = set(reference) - set(state), set(state) - set(reference)
    if missing or extra:
        raise ProtocolError(
            f"{source}: model arrays do not match: missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}"
        )
    for key, ref in reference.items():
        got = state[key]
        if tuple(got.shape) != tuple(ref.shape):
            raise ProtocolError(f"{source}: array {key!r} has shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
        if got.is_floating_point() and not torch.isfinite(got).all():
            raise ProtocolError(f"{source}: array {key!r} contains NaN or Inf")
    return state


def arrays_of(
    content: RecordDict, reference: Mapping[str, torch.Tensor], source: str, key: str = ARRAYS
) -> dict[str, torch.Tensor]:
    """The `key` ArrayRecord of a message, checked against `reference` as in `state_of`."""
    if key not in content.array_records:
        raise ProtocolError(f"{source}: message has no {key!r} ArrayRecord")
    return state_of(content.array_records[key], reference, source)


def metrics_of(content: RecordDict, required: tuple[str, ...], source: str) -> dict[str, float]:
    """The `metrics` record of a reply, with `required` keys present and finite."""
    if METRICS not in content.metric_records:
        raise ProtocolError(f"{source}: reply has no {METRICS!r} MetricRecord")
    metrics = dict(content.metric_records[METRICS])
    for key in required:
        value = metrics.get(key)
        if not isinstance(value, (int, float)) or not np.isfinite(value):
            raise ProtocolError(f"{source}: metric {key!r} is missing or not a finite number (got {value!r})")
    return metrics


def handler_seconds(reply: RecordDict) -> float:
    """How long the reply's handler ran, as the node reported it (0 when it did not)."""
    value = reply.config_records.get(TIMING, {}).get("handler-seconds")
    return float(value) if isinstance(value, (int, float)) and np.isfinite(value) and value >= 0 else 0.0


def content(
    arrays: ArrayRecord | None = None, config: Mapping | None = None, metrics: Mapping | None = None,
    side: ArrayRecord | None = None,
) -> RecordDict:
    """A RecordDict with the standard keys, leaving out what is None."""
    records: dict = {}
    if arrays is not None:
        records[ARRAYS] = arrays
    if side is not None:
        records[SIDE] = side
    if config is not None:
        records[CONFIG] = ConfigRecord(dict(config))
    if metrics is not None:
        records[METRICS] = MetricRecord(dict(metrics))
    return RecordDict(records)


def nbytes(records: RecordDict) -> int:
    """Serialized size of a message's content, as Flower puts it on the wire."""
    return recorddict_to_proto(records).ByteSize()
