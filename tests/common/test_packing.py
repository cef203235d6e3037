"""Packed records: exact round trips, fewer arrays on the wire, and clear errors for bad layouts."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from florist.common import packing
from florist.common.models import build_model


def model_record() -> RecordDict:
    state = build_model("cnn", (1, 8, 8), 10).state_dict()
    arrays = {k: Array(v.numpy()) for k, v in state.items()}
    arrays |= {"count": Array(np.array(7, dtype=np.int64)), "empty": Array(np.zeros((0, 3), np.float32))}
    return RecordDict(
        {
            "arrays": ArrayRecord(arrays),
            "config": ConfigRecord({"lr": 0.1}),
            "metrics": MetricRecord({"num-examples": 3}),
            "side": ArrayRecord({"z": Array(np.ones(4))}),
        }
    )


def test_a_packed_record_restores_every_array_bit_for_bit():
    content = model_record()
    packed = packing.pack(content)
    assert packing.is_packed(packed) and not packing.is_packed(content)
    assert len(packed["arrays"]) == 2  # one array per dtype (float32, int64) instead of 10
    restored = packing.unpack(packed, "test")
    assert list(restored["arrays"].keys()) == list(content["arrays"].keys())
    for key, array in content["arrays"].items():
        got = restored["arrays"][key].numpy()
        assert got.dtype == array.numpy().dtype and got.shape == array.numpy().shape
        assert got.tobytes() == array.numpy().tobytes()
    assert restored["config"] == content["config"] and restored["metrics"] == content["metrics"]
    assert restored["side"]["z"].numpy().tolist() == [1.0] * 4  # a single array travels as it is


def test_an_unpacked_message_passes_through_unchanged():
    content = model_record()
    restored = packing.unpack(content, "test")
    assert list(restored.keys()) == list(content.keys())
    assert restored["arrays"]["head.bias"].numpy().tobytes() == content["arrays"]["head.bias"].numpy().tobytes()


def tampered(**layout_changes) -> RecordDict:
    packed = packing.pack(model_record())
    layout = dict(packed["arrays" + packing.LAYOUT])
    layout.update(layout_changes)
    packed["arrays" + packing.LAYOUT] = ConfigRecord(layout)
    return packed


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"keys": ["only-one"]}, "equal length"),
        ({"dtypes": ["float64"] * 10}, "no float64 values"),
        ({"shapes": ["99999"] * 10}, "too few float32 values"),
        ({"shapes": ["a,b"] * 10}, "comma-separated integers"),
        ({"shapes": ["1"] * 10}, "values for a layout of"),
    ],
)
def test_a_layout_that_does_not_fit_its_arrays_is_refused_naming_the_source(changes, message):
    with pytest.raises(packing.PackingError, match=f"node 7: packed record 'arrays': .*{message}"):
        packing.unpack(tampered(**changes), "node 7")


def test_a_layout_without_its_arrays_is_refused():
    packed = packing.pack(model_record())
    del packed["arrays"]
    with pytest.raises(packing.PackingError, match="layouts without arrays"):
        packing.unpack(packed, "node 7")


DECODED = [
    np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    np.array(7, dtype=np.int64),
    np.zeros((0, 3), np.float32),
    np.arange(6, dtype=">f8").reshape(3, 2),  # big-endian
    np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),  # Fortran order: left to numpy
    np.array([True, False]),
    np.zeros(3, dtype=[("a", "<i4"), ("b", "<f2")]),
]


@pytest.mark.parametrize("values", DECODED, ids=range(len(DECODED)))
def test_decode_gives_what_numpy_loads_twice_over(values):
    array = Array(values)
    for _ in range(2):  # the second time from the remembered header
        got, want = packing.decode(array), array.numpy()
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
        assert got.flags.writeable and got.flags.c_contiguous == want.flags.c_contiguous


@pytest.mark.parametrize(
    "data",
    [
        Array(np.arange(5, dtype=np.float32)).data[:-4],  # a value short
        Array(np.arange(5, dtype=np.float32)).data[:20],  # inside the header
        b"\x93NUMPY\x01\x00\xff\xff{'descr': '<f4'",  # a header longer than its bytes
        b"not a .npy file at all",
    ],
)
def test_decode_raises_where_numpy_raises(data):
    array = Array(dtype="float32", shape=(5,), stype="numpy.ndarray", data=data)
    with pytest.raises(Exception) as numpy_error:
        array.numpy()
    with pytest.raises(type(numpy_error.value)):
        packing.decode(array)
    with pytest.raises(type(numpy_error.value)):  # once its header is known too
        packing.decode(Array(np.arange(5, dtype=np.float32)))
        packing.decode(array)


def test_a_known_header_is_not_parsed_again(monkeypatch):
    array = Array(np.arange(12, dtype=np.float32).reshape(3, 4))
    packing.decode(array)
    monkeypatch.setattr(np.lib.format, "read_array_header_1_0", None)
    monkeypatch.setattr(Array, "numpy", None)
    assert packing.decode(Array(np.ones((3, 4), np.float32))).tolist() == [[1.0] * 4] * 3


@pytest.mark.parametrize("values", DECODED, ids=range(len(DECODED)))
def test_encode_writes_what_flower_writes_twice_over(values):
    for _ in range(2):  # the second time with the remembered header
        got, want = packing.encode(values), Array(values)
        assert (got.dtype, got.shape, got.stype, got.data) == (want.dtype, want.shape, want.stype, want.data)
