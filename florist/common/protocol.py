"""What travels between server and clients: message types, record keys, a request's config
record (`message_config`), and the checks on what arrives. Record layout follows Flower's
convention so that Flower's own strategies can drive florist clients: model under `arrays`,
settings under `config`, numbers under `metrics` (with `num-examples`)."""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.serde import recorddict_to_proto

from florist.common.packing import NPY_HEADER_MAX, decode

if TYPE_CHECKING:
    from florist.common.spec import Exchange
    from florist.config import RunConfig

ARRAYS, CONFIG, METRICS = "arrays", "config", "metrics"
SIDE = "side"  # arrays sent beside the model (FedAttn: representation, bias gradient)
TIMING = "timing"  # ConfigRecord of every florist reply: `handler-seconds`, the handler's own time
RECORD_DP = "dp-record"  # ConfigRecord of a reply under record-level dp: the node's ε so far (client/ledger.py)
RECORD_DP_FIELDS = {"epsilon": float, "sigma": float, "q": float, "steps": int, "delta": float, "clip": float}
PLACE = "place"  # ConfigRecord of a reply made in a Ray actor: where it ran (`client/messages.py`)
PLACE_FORMS = {  # what each of its keys may hold: it goes into results.json
    "ray-node": re.compile(r"[0-9a-f]{1,64}"),
    "ray-node-ip": re.compile(r"[0-9A-Fa-f.:]{2,45}"),
    "host": re.compile(r"[A-Za-z0-9._-]{1,253}"),
}
COUNTS = ("num-examples", "num-train", "num-val", "num-test")  # metrics that count samples
MAX_COUNT = 2**53  # the largest count a float holds exactly
INFO_METRICS = ("num-train", "num-test", "seen")  # what a `query.info` reply must carry
# No weight, gradient, descriptor or soft decision a node computes comes near it; a value beyond
# it is a diverged or broken node, and it would overflow float32 where servers square and sum
# what they receive (Adam's second moments, k-means distances).
MAX_MAGNITUDE = 1e9
# An input shape beyond this many values (a 3×2048×2048 image is 12.6M) would make the server
# build a model it cannot hold: a node that claims one is left out at discovery.
MAX_INPUT_VALUES = 2**24
MAX_INPUT_DIMS = 4
MB = 10**6  # what `max-reply-mb` counts in
# The most characters of a failure's reason that logs, results.json, report.md and checkpoints
# keep (`one_line`): a node chooses its error replies' reasons, of any length and content.
REASON_CHARS = 300

# Message types are declared by the algorithms' specs (florist/strategies/<name>/spec.py).


class ProtocolError(ValueError):
    """A reply or request that does not have the expected content."""


# An ANSI/VT escape sequence (CSI, OSC, or one character after ESC): what a terminal would obey.
ESCAPE = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]?|\][^\x07\x1b]*(\x07|\x1b\\)?|.?)", re.DOTALL)
WHITESPACE = re.compile(r"\s+")


def one_line(text: object, limit: int = REASON_CHARS) -> str:
    """`text` as a log line or a report may show it, whoever wrote it: one line of printable
    characters (escape sequences dropped, line breaks and other controls made spaces or "?"),
    at most `limit` characters, saying when it was cut. Only its first `limit` characters are
    read, so a reason of megabytes is never copied."""
    text = text if isinstance(text, str) else repr(text)
    line = WHITESPACE.sub(" ", ESCAPE.sub("", text[: limit + 1]))
    line = "".join(c if c.isprintable() else "?" for c in line).strip()
    if len(text) <= limit:
        return line
    cut = f"... (cut from {len(text)} characters)"
    return line[: limit - len(cut)] + cut


def to_record(model: torch.nn.Module) -> ArrayRecord:
    return ArrayRecord(model.state_dict())


def tensors_of(record: ArrayRecord, source: str) -> dict[str, torch.Tensor]:
    """The arrays of `record` as tensors; ProtocolError when one does not decode."""
    try:
        return OrderedDict((key, torch.from_numpy(decode(array))) for key, array in record.items())
    except Exception as err:
        raise ProtocolError(f"{source}: an array does not decode ({type(err).__name__}: {err})") from err


def state_of(
    record: ArrayRecord, reference: Mapping[str, torch.Tensor], source: str, convert: bool = False
) -> dict[str, torch.Tensor]:
    """Tensors of `record`, checked against `reference`: same keys, shapes and dtypes, finite
    values within ±`MAX_MAGNITUDE`. With `convert`, an array of another real dtype is first
    converted to the reference's, as `load_state_dict` would (Flower's own strategies send
    float64 after their arithmetic), and checked as converted.

    `source` names where the record came from (a node, a file) for the error message. Keys,
    shapes and dtypes are checked as the arrays declare them before any is decoded
    (`check_declared`), and again as decoded.
    """
    check_declared(record, reference, source, convert)
    state = tensors_of(record, source)
    _check_keys(set(state), reference, source)
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


def _check_keys(keys: set[str], reference: Mapping[str, torch.Tensor], source: str) -> None:
    missing, extra = set(reference) - keys, keys - set(reference)
    if missing or extra:
        raise ProtocolError(
            f"{source}: model arrays do not match: missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}"
        )


def check_declared(
    record: ArrayRecord, reference: Mapping[str, torch.Tensor], source: str, convert: bool = False
) -> None:
    """`record`'s keys, and each array's shape and dtype as its header declares them
    (`Array.shape`, `Array.dtype`), checked against `reference` without decoding anything; and
    no array holding more bytes than its declared shape and dtype need (a node cannot declare a
    small array and send a large one). With `convert`, any real dtype of the right shape passes."""
    _check_keys(set(record), reference, source)
    for key, ref in reference.items():
        array, expected = record[key], str(ref.dtype).removeprefix("torch.")
        shape = tuple(array.shape)
        if shape != tuple(ref.shape):
            raise ProtocolError(f"{source}: array {key!r} has shape {shape}, expected {tuple(ref.shape)}")
        if array.dtype != expected and not convert:
            raise ProtocolError(f"{source}: array {key!r} has dtype torch.{array.dtype}, expected {ref.dtype}")
        try:
            itemsize = np.dtype(array.dtype).itemsize
        except (TypeError, ValueError) as err:  # ValueError: "(-1,)f8"
            raise ProtocolError(
                f"{source}: array {key!r} has no dtype numpy knows ({one_line(repr(array.dtype), 60)})"
            ) from err
        if len(array.data) > math.prod(shape) * itemsize + NPY_HEADER_MAX:
            raise ProtocolError(
                f"{source}: array {key!r} holds {len(array.data)} bytes, more than its shape {shape} of "
                f"{array.dtype} takes"
            )


def _check_values(values: torch.Tensor, key: str, source: str) -> None:
    """Finite floating values within ±MAX_MAGNITUDE. One pass in numpy (its min and max, which
    NaN turns NaN), single-threaded: torch's two full passes ran as parallel regions whose
    threads, on a server whose cores its simulated clients hold, cost ~8 ms of CPU per reply of
    LeNet. Which of the two is wrong is worked out only once something is."""
    if not values.is_floating_point() or not values.numel():
        return
    values = values.detach().cpu()
    array = (values.float() if values.dtype == torch.bfloat16 else values).numpy()  # numpy has no bfloat16
    if -MAX_MAGNITUDE <= array.min() and array.max() <= MAX_MAGNITUDE:
        return
    if not np.isfinite(array).all():
        raise ProtocolError(f"{source}: array {key!r} contains NaN or Inf")
    raise ProtocolError(f"{source}: array {key!r} has values beyond ±{MAX_MAGNITUDE:g}")


def arrays_of(
    content: RecordDict, reference: Mapping[str, torch.Tensor], source: str, key: str = ARRAYS, convert: bool = False
) -> dict[str, torch.Tensor]:
    """The `key` ArrayRecord of a message, checked against `reference` as in `state_of`."""
    if key not in content.array_records:
        raise ProtocolError(f"{source}: message has no {key!r} ArrayRecord")
    return state_of(content.array_records[key], reference, source, convert)


def metrics_of(content: RecordDict, required: tuple[str, ...], source: str) -> dict[str, float | str]:
    """The `metrics` record of a reply: the `required` keys present, every value a finite
    number, and the counts (`COUNTS`) whole numbers from 0 to `MAX_COUNT`. Beside them, where
    the reply says it ran (`place_of`), which a client's row in results.json keeps."""
    if METRICS not in content.metric_records:
        raise ProtocolError(f"{source}: reply has no {METRICS!r} MetricRecord")
    metrics = dict(content.metric_records[METRICS])
    for key in (*required, *(k for k in metrics if k not in required)):
        value = metrics.get(key)
        if not isinstance(value, (int, float)) or not np.isfinite(value):
            what = "missing or not" if key in required else "not"
            shown = repr(value[:3])[:-1] + ", ...]" if isinstance(value, list) and len(value) > 3 else repr(value)
            raise ProtocolError(f"{source}: metric {key!r} is {what} a finite number (got {shown})")
        if key in COUNTS and not (value == int(value) and 0 <= value <= MAX_COUNT):
            raise ProtocolError(f"{source}: metric {key!r} counts samples, but is {value!r}")
    return metrics | place_of(content, source)


def place_of(content: RecordDict, source: str) -> dict[str, str]:
    """Where a reply says it ran (its `PLACE` record; empty when it has none), each key one of
    `PLACE_FORMS` and of its form."""
    place = dict(content.config_records.get(PLACE, {}))
    for key, value in place.items():
        if key not in PLACE_FORMS or not isinstance(value, str) or not PLACE_FORMS[key].fullmatch(value):
            raise ProtocolError(f"{source}: {PLACE} {key!r} is not one of {sorted(PLACE_FORMS)} in its form")
    return place


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
        raise ProtocolError(f"{source}: input-shape must be a list of positive integers (got {repr(shape)[:60]})")
    if len(shape) > MAX_INPUT_DIMS or math.prod(shape) > MAX_INPUT_VALUES:
        raise ProtocolError(
            f"{source}: input-shape {repr(shape)[:60]} is beyond {MAX_INPUT_DIMS} dimensions of "
            f"{MAX_INPUT_VALUES} values in all"
        )
    return key, tuple(shape), metrics


# What a `query.info` reply says of the node's data, for report.md (all optional, bounded here:
# a node chooses them): where it came from, its classes' names, and the bad files it left out.
DATA_SOURCE, CLASS_NAMES, SKIPPED_FILES = "data-source", "class-names", "skipped-files"
MAX_NAMES, MAX_NAMED_FILES, NAME_CHARS = 1000, 20, 200


def data_of(content: RecordDict, source: str) -> dict[str, Any]:
    """What a `query.info` reply says of its node's data (`DATA_SOURCE`, `CLASS_NAMES`,
    `SKIPPED_FILES` in its config record): each a string or a list of strings, kept as one-line
    text of at most `NAME_CHARS` characters, the lists cut to `MAX_NAMES` and `MAX_NAMED_FILES`;
    empty when it says nothing (a node of an earlier florist)."""
    config = content.config_records.get(CONFIG, {})
    said: dict[str, Any] = {}
    for key, most in ((DATA_SOURCE, 0), (CLASS_NAMES, MAX_NAMES), (SKIPPED_FILES, MAX_NAMED_FILES)):
        if key not in config:
            continue
        value = config[key]
        if not (isinstance(value, str) if not most else isinstance(value, list) and all(type(v) is str for v in value)):
            raise ProtocolError(f"{source}: {key} must be {'a string' if not most else 'a list of strings'}")
        said[key] = one_line(value, NAME_CHARS) if not most else [one_line(v, NAME_CHARS) for v in value[:most]]
    return said


def handler_seconds(reply: RecordDict, part: str = "handler") -> float:
    """How long the reply's handler ran (`part` "data": how long of it went to loading the
    node's data), as the node reported it (0 when it did not)."""
    value = reply.config_records.get(TIMING, {}).get(f"{part}-seconds")
    return float(value) if isinstance(value, (int, float)) and np.isfinite(value) and value >= 0 else 0.0


def record_dp_of(reply: RecordDict) -> dict[str, float | str] | None:
    """What a reply says of its node's record-level dp (`RECORD_DP`), its numbers finite and at least 0
    and its accountant a name; None when it says nothing, or nothing usable (a node's own claim: kept
    as it says, never trusted for anything but the report)."""
    said = reply.config_records.get(RECORD_DP)
    if said is None:
        return None
    out: dict[str, float | str] = {}
    for key, kind in RECORD_DP_FIELDS.items():
        value = said.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
            out[key] = kind(value)
    if str(said.get("accountant", "")) in ("rdp", "pld"):
        out["accountant"] = str(said["accountant"])
    if "guarantee" in said:
        out["guarantee"] = one_line(str(said["guarantee"]))[:80]
    return out if "sigma" in out else None


def message_config(cfg: RunConfig, exchange: Exchange, server_round: int, run_id: int, **values: Any) -> dict[str, Any]:
    """A request's `config` record: the run's settings that travel (the common ones and the
    strategy's section), the round and run id, and the exchange's own settings, by its dataclass."""
    own = exchange.settings(**values).to_mapping()
    return cfg.to_mapping(travelling=True) | {"server-round": server_round, "run-id": run_id} | own


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
    """Serialized size of a message's content, as Flower puts it on the wire (serializing it:
    a copy of all of it, so weigh a reply with `declared_nbytes` first)."""
    return recorddict_to_proto(records).ByteSize()


def array_nbytes(records: RecordDict) -> int:
    """The bytes the arrays of a message's content hold."""
    return sum(len(array.data) for record in records.array_records.values() for array in record.values())


def declared_nbytes(records: RecordDict) -> int:
    """About what a message's content weighs on the wire, read from what is there without
    decoding or serializing any of it: its arrays' bytes, and the keys and values of its other
    records (a number counts 8 bytes)."""
    size = array_nbytes(records)
    for record in records.values():
        size += sum(len(key) + (0 if isinstance(record, ArrayRecord) else _weight(v)) for key, v in record.items())
    return size


def _weight(value: object) -> int:
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, list):
        return sum(map(_weight, value))
    return 8


def expected_nbytes(reference: Mapping[str, torch.Tensor]) -> int:
    """The bytes a record of arrays like `reference` holds."""
    return sum(t.numel() * t.element_size() for t in reference.values())
