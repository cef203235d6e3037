"""Transport framing of florist's own messages: a record of many arrays travels as one array
per dtype.

Flower 1.39 moves every Array of a message as an object of its own, one request each, from the
ServerApp to the SuperLink, to the SuperNode, to the ClientApp and back again: a model of eight
tensors costs eight requests at every hop, and on a small machine those requests, not the
bytes, are what an exchange waits for. Packed, a model costs one. Packing is exact (the values
are concatenated, never converted) and invisible to the algorithms: florist's server packs what
it sends and unpacks the replies (`Exchanger.exchange`); florist's ClientApp unpacks what it
receives and packs its replies to florist's own message types, and to Flower's standard ones
only when the request came packed, so Flower's own strategies, which send and expect one
Array per tensor, get what they always got.
"""

from __future__ import annotations

import math

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

LAYOUT = ".layout"  # the ConfigRecord `<name>.layout` describes the packed ArrayRecord `<name>`
# What an array's bytes may hold beyond its values: Flower stores each as a .npy file, whose
# header (dtype and shape as text) is 128 bytes for a model's arrays, 64 KiB at the most numpy writes.
NPY_HEADER_MAX = 2**16


class PackingError(ValueError):
    """A packed record whose layout does not match its arrays."""


def pack(content: RecordDict) -> RecordDict:
    """`content` with every ArrayRecord of more than one array packed."""
    packed = RecordDict()
    for name, record in content.items():
        if not isinstance(record, ArrayRecord) or len(record) < 2:
            packed[name] = record
            continue
        groups: dict[str, list[np.ndarray]] = {}
        layout: dict[str, list[str]] = {"keys": [], "dtypes": [], "shapes": []}
        for key, array in record.items():
            values = array.numpy()
            groups.setdefault(str(values.dtype), []).append(values.ravel())
            layout["keys"].append(key)
            layout["dtypes"].append(str(values.dtype))
            layout["shapes"].append(",".join(str(d) for d in values.shape))
        packed[name] = ArrayRecord({dtype: Array(np.concatenate(parts)) for dtype, parts in groups.items()})
        packed[name + LAYOUT] = ConfigRecord(layout)
    return packed


def is_packed(content: RecordDict) -> bool:
    return any(name.endswith(LAYOUT) for name in content.config_records)


def unpack(content: RecordDict, source: str) -> RecordDict:
    """`content` with its packed records restored; raises PackingError naming `source` (the
    node or message it came from) when a layout does not fit its arrays."""
    layouts = {name[: -len(LAYOUT)]: record for name, record in content.config_records.items() if name.endswith(LAYOUT)}
    unpacked = RecordDict()
    for name, record in content.items():
        if name.endswith(LAYOUT):
            continue
        if name in layouts:
            if not isinstance(record, ArrayRecord):
                raise PackingError(f"{source}: {name!r} has a layout but is not an ArrayRecord")
            record = _restore(record, layouts.pop(name), f"{source}: packed record {name!r}")
        unpacked[name] = record
    if layouts:
        raise PackingError(f"{source}: layouts without arrays: {sorted(layouts)}")
    return unpacked


def _restore(record: ArrayRecord, layout: ConfigRecord, where: str) -> ArrayRecord:
    """The arrays `layout` describes, cut from `record`'s flat arrays, once the layout and
    what each flat array declares (dtype, shape, bytes) agree: nothing is decoded before."""
    keys, dtypes, shapes = (layout.get(field) for field in ("keys", "dtypes", "shapes"))
    if not all(isinstance(v, list) for v in (keys, dtypes, shapes)) or not len(keys) == len(dtypes) == len(shapes):
        raise PackingError(f"{where}: its layout needs lists keys, dtypes and shapes of equal length")
    if len(set(map(str, keys))) < len(keys):
        raise PackingError(f"{where}: its layout names a key twice")
    try:
        dims = [tuple(int(d) for d in str(shape).split(",") if d) for shape in shapes]
    except ValueError as err:
        raise PackingError(f"{where}: shapes must be comma-separated integers ({err})") from err
    sizes = _declared_sizes(record, where)
    offsets = dict.fromkeys(sizes, 0)
    for key, dtype, shape in zip(keys, dtypes, dims):
        size = math.prod(shape)  # a Python int: a lying shape cannot overflow it
        if dtype not in sizes or min(shape, default=0) < 0:
            raise PackingError(f"{where}: no {dtype} values for {key!r}")
        if offsets[dtype] + size > sizes[dtype]:
            raise PackingError(f"{where}: too few {dtype} values for {key!r} of shape {shape}")
        offsets[dtype] += size
    if offsets != sizes:
        raise PackingError(f"{where}: {sum(sizes.values())} values for a layout of {sum(offsets.values())}")
    try:
        flat = {dtype: array.numpy() for dtype, array in record.items()}
    except Exception as err:
        raise PackingError(f"{where}: arrays must be decodable ({err})") from err
    if any(
        values.ndim != 1 or values.size != sizes[dtype] or str(values.dtype) != dtype for dtype, values in flat.items()
    ):
        raise PackingError(f"{where}: packed arrays must be flat, as declared")
    offsets = dict.fromkeys(flat, 0)
    arrays = {}
    for key, dtype, shape in zip(keys, dtypes, dims):
        size = math.prod(shape)
        arrays[str(key)] = Array(flat[dtype][offsets[dtype] : offsets[dtype] + size].reshape(shape).copy())
        offsets[dtype] += size
    return ArrayRecord(arrays)


def _declared_sizes(record: ArrayRecord, where: str) -> dict[str, int]:
    """Values per dtype of a packed record's flat arrays, as each declares them (its key, dtype
    and shape), checked against the bytes it holds, without decoding any."""
    sizes = {}
    for dtype, array in record.items():
        try:
            itemsize = np.dtype(array.dtype).itemsize
        except TypeError as err:
            raise PackingError(f"{where}: no dtype numpy knows in {dtype!r} ({err})") from err
        if array.dtype != dtype or len(array.shape) != 1:
            raise PackingError(f"{where}: packed arrays must be flat, each under its dtype (got {dtype!r})")
        if len(array.data) > array.shape[0] * itemsize + NPY_HEADER_MAX:
            raise PackingError(f"{where}: {dtype} holds {len(array.data)} bytes, more than its {array.shape[0]} values")
        sizes[dtype] = int(array.shape[0])
    return sizes
