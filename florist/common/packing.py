"""Transport framing of florist's own messages: a record of many arrays travels as one array
per dtype.

Flower 1.39 moves every Array of a message as an object of its own, one request each, from the
ServerApp to the SuperLink, to the SuperNode, to the ClientApp and back again: a model of eight
tensors costs eight requests at every hop, and on a small machine those requests, not the
bytes, are what an exchange waits for. Packed, a model costs one. Packing is exact (the values
are concatenated, never converted) and invisible to the algorithms: florist's server packs what
it sends and unpacks the replies (`Exchanger.round_trip`); florist's ClientApp unpacks what it
receives and packs its replies to florist's own message types, and to Flower's standard ones
only when the request came packed, so Flower's own strategies, which send and expect one
Array per tensor, get what they always got.
"""

from __future__ import annotations

import io
import math
import re

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

LAYOUT = ".layout"  # the ConfigRecord `<name>.layout` describes the packed ArrayRecord `<name>`
# What an array's bytes may hold beyond its values: Flower stores each as a .npy file, whose
# header (dtype and shape as text) is 128 bytes for a model's arrays, 64 KiB at the most numpy writes.
NPY_HEADER_MAX = 2**16
# What a layout may declare, well beyond any model (whose arrays have a few dimensions and at
# most millions of values), and within what numpy's reshape takes: at most 64 dimensions, each
# under 2**63, and under 2**63 bytes counting every non-zero dimension.
MAX_ARRAYS = 2**16  # arrays in one packed record
MAX_DIMS = 32
MAX_BYTES = 2**48
SHAPE = re.compile(r"([0-9]{1,19}(,[0-9]{1,19})*)?")  # what `pack` writes: "", "7", "3,0,5"
SHAPE_CHARS = MAX_DIMS * 20
SHOWN = 60  # characters of a sender's key or dtype that an error message shows
NPY_V1 = b"\x93NUMPY\x01\x00"  # what a .npy header of format 1.0 (all np.save writes for a model) starts with
HEADERS_KEPT = 256  # parsed .npy headers remembered (a model has a few layouts)
_headers: dict[bytes, tuple[tuple[int, ...], np.dtype]] = {}
_written: dict[tuple[np.dtype, tuple[int, ...]], bytes] = {}  # the .npy header np.save writes, by layout


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
            values = decode(array)
            groups.setdefault(str(values.dtype), []).append(values.ravel())
            layout["keys"].append(key)
            layout["dtypes"].append(str(values.dtype))
            layout["shapes"].append(",".join(str(d) for d in values.shape))
        packed[name] = ArrayRecord({dtype: encode(np.concatenate(parts)) for dtype, parts in groups.items()})
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
    what each flat array declares (dtype, shape, bytes) agree: nothing is decoded before, and
    numpy sees no shape it could refuse (`_shapes`)."""
    keys, dtypes, shapes = (layout.get(field) for field in ("keys", "dtypes", "shapes"))
    if not all(isinstance(v, list) for v in (keys, dtypes, shapes)) or not len(keys) == len(dtypes) == len(shapes):
        raise PackingError(f"{where}: its layout needs lists keys, dtypes and shapes of equal length")
    if len(keys) > MAX_ARRAYS:
        raise PackingError(f"{where}: its layout names {len(keys)} arrays, more than {MAX_ARRAYS}")
    if len(set(map(str, keys))) < len(keys):
        raise PackingError(f"{where}: its layout names a key twice")
    sizes, itemsizes = _declared_sizes(record, where)
    dims = _shapes(keys, dtypes, shapes, itemsizes, where)
    offsets = dict.fromkeys(sizes, 0)
    for key, dtype, shape in zip(keys, dtypes, dims):
        size = math.prod(shape)  # a Python int: a lying shape cannot overflow it
        if offsets[dtype] + size > sizes[dtype]:
            raise PackingError(f"{where}: too few {dtype} values for {_shown(key)} of shape {shape}")
        offsets[dtype] += size
    if offsets != sizes:
        raise PackingError(f"{where}: {sum(sizes.values())} values for a layout of {sum(offsets.values())}")
    try:
        flat = {dtype: decode(array) for dtype, array in record.items()}
    except Exception as err:
        raise PackingError(f"{where}: arrays must be decodable ({type(err).__name__})") from err
    if any(
        values.ndim != 1 or values.size != sizes[dtype] or str(values.dtype) != dtype for dtype, values in flat.items()
    ):
        raise PackingError(f"{where}: packed arrays must be flat, as declared")
    offsets = dict.fromkeys(flat, 0)
    arrays = {}
    for key, dtype, shape in zip(keys, dtypes, dims):
        size = math.prod(shape)
        arrays[str(key)] = encode(flat[dtype][offsets[dtype] : offsets[dtype] + size].reshape(shape))
        offsets[dtype] += size
    return ArrayRecord(arrays)


def encode(values: np.ndarray) -> Array:
    """`Array(values)`, byte for byte, with the .npy header np.save writes taken once per dtype
    and shape; an array not in C order, or of a structured or object dtype, is `Array(values)`."""
    dtype = values.dtype
    if not values.flags.c_contiguous or dtype.fields is not None or dtype.subdtype is not None or dtype.hasobject:
        return Array(values)
    shape = tuple(values.shape)
    if (header := _written.get((dtype, shape))) is None:
        array = Array(values)
        if len(_written) >= HEADERS_KEPT:
            _written.clear()
        _written[dtype, shape] = array.data[: len(array.data) - values.nbytes]
        return array
    return Array(dtype=str(dtype), shape=shape, stype="numpy.ndarray", data=header + values.tobytes())


def decode(array: Array) -> np.ndarray:
    """`array.numpy()`, with each distinct .npy header parsed once: numpy parses it (with
    `ast.literal_eval`) on every load, most of what decoding a small model's arrays costs. Only
    a C-order array of a header numpy has parsed, with all its values present, is read here;
    anything else goes to `Array.numpy`, which decodes it or raises as it always did."""
    data = array.data
    if array.stype != "numpy.ndarray" or not data.startswith(NPY_V1) or len(data) < 10:
        return array.numpy()
    start = 10 + int.from_bytes(data[8:10], "little")
    header = data[:start]
    if (layout := _headers.get(header)) is None:
        try:
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(io.BytesIO(header[8:]))
        except Exception:
            return array.numpy()
        if fortran or dtype.hasobject or dtype.itemsize == 0:
            return array.numpy()
        if len(_headers) >= HEADERS_KEPT:
            _headers.clear()
        layout = _headers[header] = (shape, dtype)
    shape, dtype = layout
    count = math.prod(shape)
    if len(data) - start < count * dtype.itemsize:
        return array.numpy()
    return np.frombuffer(data, dtype, count, start).reshape(shape).copy()


def _shapes(keys: list, dtypes: list, shapes: list, itemsizes: dict[str, int], where: str) -> list[tuple[int, ...]]:
    """The layout's shapes as tuples, each checked as numpy would check it in a reshape, but
    raising PackingError: of one of the record's dtypes, at most `MAX_DIMS` dimensions, each a
    non-negative decimal, and, its zero dimensions left out (numpy counts the others even in an
    empty array), at most `MAX_BYTES`."""
    dims = []
    for key, dtype, shape in zip(keys, dtypes, shapes):
        if not isinstance(dtype, str) or dtype not in itemsizes:
            raise PackingError(f"{where}: no {_shown(dtype, quoted=False)} values for {_shown(key)}")
        if not isinstance(shape, str) or len(shape) > SHAPE_CHARS or not SHAPE.fullmatch(shape):
            raise PackingError(
                f"{where}: the shape of {_shown(key)} must be comma-separated integers (got {_shown(shape)})"
            )
        dims.append(tuple(int(d) for d in shape.split(",") if d))
        if len(dims[-1]) > MAX_DIMS:
            raise PackingError(f"{where}: {_shown(key)} has {len(dims[-1])} dimensions, more than {MAX_DIMS}")
        if math.prod(d for d in dims[-1] if d) * max(itemsizes[dtype], 1) > MAX_BYTES:
            raise PackingError(f"{where}: {_shown(key)} has a shape beyond {MAX_BYTES} bytes ({_shown(shape)})")
    return dims


def _declared_sizes(record: ArrayRecord, where: str) -> tuple[dict[str, int], dict[str, int]]:
    """Values per dtype of a packed record's flat arrays, as each declares them (its key, dtype
    and shape), checked against the bytes it holds, without decoding any; and each dtype's
    bytes per value."""
    sizes, itemsizes = {}, {}
    for dtype, array in record.items():
        try:
            itemsizes[dtype] = np.dtype(array.dtype).itemsize
        except Exception as err:  # TypeError for most strings; a dtype is the sender's text
            raise PackingError(f"{where}: no dtype numpy knows in {_shown(dtype)} ({type(err).__name__})") from err
        if array.dtype != dtype or len(array.shape) != 1 or array.shape[0] < 0:
            raise PackingError(f"{where}: packed arrays must be flat, each under its dtype (got {_shown(dtype)})")
        if len(array.data) > array.shape[0] * itemsizes[dtype] + NPY_HEADER_MAX:
            raise PackingError(f"{where}: {dtype} holds {len(array.data)} bytes, more than its {array.shape[0]} values")
        sizes[dtype] = int(array.shape[0])
    return sizes, itemsizes


def _shown(value: object, quoted: bool = True) -> str:
    """`value` as an error message may show it: a sender chose it, so cut short, and its repr
    unless it is printable text and not `quoted`."""
    if isinstance(value, (str, bytes, list)) and len(value) > SHOWN:
        value = value[:SHOWN]
    text = value if isinstance(value, str) and value.isprintable() and not quoted else repr(value)
    return text if len(text) <= SHOWN else text[:SHOWN] + "..."
