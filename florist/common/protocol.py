"""What travels between server and clients: message types, record keys, and the checks on
what arrives. Record layout follows Flower's convention so that Flower's own strategies can
drive florist clients: model under `arrays`, settings under `config`, numbers under `metrics`
(with `num-examples`)."""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.serde import recorddict_to_proto

ARRAYS, CONFIG, METRICS = "arrays", "config", "metrics"
SIDE = "side"  # arrays sent beside the model (FedAttn: representation, bias gradient)
TIMING = "timing"  # ConfigRecord of every florist reply: `handler-seconds`, the handler's own time
COUNTS = ("num-examples", "num-train", "num-val", "num-test")  # metrics that count samples
MAX_COUNT = 2**53  # the largest count a float holds exactly
INFO_METRICS = ("num-train", "num-test", "seen")  # what a `query.info` reply must carry
# No weight, gradient, descriptor or soft decision a node computes comes near it; a value beyond
# it is a diverged or broken node, and it would overflow float32 where servers square and sum
# what they receive (Adam's second moments, k-means distances).
MAX_MAGNITUDE = 1e9

# Message types are declared by the algorithms' specs (florist/strategies/<name>/spec.py).


class ProtocolError(ValueError):
    """A reply or request that does not have the expected content."""


def to_record(model: torch.nn.Module) -> ArrayRecord:
    return ArrayRecord(model.state_dict())


def tensors_of(record: ArrayRecord, source: str) -> dict[str, torch.Tensor]:
    """The arrays of `record` as tensors; ProtocolError when one does not decode."""
    try:
        return record.to_torch_state_dict()
    except Exception as err:
        raise ProtocolError(f"{source}: an array does not decode ({type(err).__name__}: {err})") from err


def state_of(
    record: ArrayRecord, reference: Mapping[str, torch.Tensor], source: str, convert: bool = False
) -> dict[str, torch.Tensor]:
    """Tensors of `record`, checked against `reference`: same keys, shapes and dtypes, finite
    values within ±`MAX_MAGNITUDE`. With `convert`, an array of another real dtype is first
    converted to the reference's, as `load_state_dict` would (Flower's own strategies send
    float64 after their arithmetic), and checked as converted.

    `source` names where the record came from (a node, a file) for the error message.
    """
    state = tensors_of(record, source)
    missing, extra = set(reference) - set(state), set(state) - set(reference)
    if missing or extra:
        raise ProtocolError(
            f"{source}: model arrays do not match: missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}"
        )
    for key, ref in reference.items():
        got = state[key]
        if tuple(got.shape) != tuple(ref.shape):
            raise ProtocolError(f"{source}: array {key!r} has shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
        if got.dtype != ref.dtype and convert and not (got.is_complex() or got.dtype == torch.bool):
            _check_values(got, key, source)  # before: NaN or 1e300 would not survive conversion to an integer
            got = state[key] = got.to(ref.dtype)
        if got.dtype != ref.dtype:
            raise ProtocolError(f"{source}: array {key!r} has dtype {got.dtype}, expected {ref.dtype}")
        _check_values(got, key, source)
    return state


def _check_values(values: torch.Tensor, key: str, source: str) -> None:
    if values.is_floating_point() and not torch.isfinite(values).all():
        raise ProtocolError(f"{source}: array {key!r} contains NaN or Inf")
    if values.is_floating_point() and (values.abs() > MAX_MAGNITUDE).any():
        raise ProtocolError(f"{source}: array {key!r} has values beyond ±{MAX_MAGNITUDE:g}")


def arrays_of(
    content: RecordDict, reference: Mapping[str, torch.Tensor], source: str, key: str = ARRAYS, convert: bool = False
) -> dict[str, torch.Tensor]:
    """The `key` ArrayRecord of a message, checked against `reference` as in `state_of`."""
    if key not in content.array_records:
        raise ProtocolError(f"{source}: message has no {key!r} ArrayRecord")
    return state_of(content.array_records[key], reference, source, convert)


def metrics_of(content: RecordDict, required: tuple[str, ...], source: str) -> dict[str, float]:
    """The `metrics` record of a reply: the `required` keys present, every value a finite
    number, and the counts (`COUNTS`) whole numbers from 0 to `MAX_COUNT`."""
    if METRICS not in content.metric_records:
        raise ProtocolError(f"{source}: reply has no {METRICS!r} MetricRecord")
    metrics = dict(content.metric_records[METRICS])
    for key in (*required, *(k for k in metrics if k not in required)):
        value = metrics.get(key)
        if not isinstance(value, (int, float)) or not np.isfinite(value):
            what = "missing or not" if key in required else "not"
            raise ProtocolError(f"{source}: metric {key!r} is {what} a finite number (got {value!r})")
        if key in COUNTS and not (value == int(value) and 0 <= value <= MAX_COUNT):
            raise ProtocolError(f"{source}: metric {key!r} counts samples, but is {value!r}")
    return metrics


# What a node may call itself: short, printable, no path or escape sequence (it goes into logs,
# file names and results), sorted without an unbounded int().
NODE_KEY = re.compile(r"[A-Za-z0-9._-]{1,128}")


def info_of(content: RecordDict, source: str) -> tuple[str, tuple[int, ...], dict[str, float]]:
    """(node key, input shape, metrics) of a `query.info` reply, checked."""
    metrics = metrics_of(content, INFO_METRICS, source)
    config = content.config_records.get(CONFIG, {})
    key, shape = config.get("node-key"), config.get("input-shape")
    if not isinstance(key, str) or not NODE_KEY.fullmatch(key):
        shown = repr(key)[:40] + ("..." if len(repr(key)) > 40 else "")
        raise ProtocolError(f"{source}: node-key must be 1-128 of A-Z a-z 0-9 . _ - (got {shown})")
    if not isinstance(shape, list) or not shape or not all(type(d) is int and d >= 1 for d in shape):
        raise ProtocolError(f"{source}: input-shape must be a list of positive integers (got {shape!r})")
    return key, tuple(shape), metrics


def handler_seconds(reply: RecordDict, part: str = "handler") -> float:
    """How long the reply's handler ran (`part` "data": how long of it went to loading the
    node's data), as the node reported it (0 when it did not)."""
    value = reply.config_records.get(TIMING, {}).get(f"{part}-seconds")
    return float(value) if isinstance(value, (int, float)) and np.isfinite(value) and value >= 0 else 0.0


def content(
    arrays: ArrayRecord | None = None,
    config: Mapping | None = None,
    metrics: Mapping | None = None,
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
