"""What a sender chose reaches numpy and the logs only once checked: a packed shape numpy
would refuse is a PackingError naming the record, and a reason is one short printable line."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from florist.common import packing, protocol


def packed(*shapes: str, values: int = 5) -> RecordDict:
    keys = [f"k{i}" for i in range(len(shapes))]
    layout = {"keys": keys, "dtypes": ["float32"] * len(keys), "shapes": list(shapes)}
    return RecordDict(
        {
            "arrays": ArrayRecord({"float32": Array(np.zeros(values, np.float32))}),
            "arrays" + packing.LAYOUT: ConfigRecord(layout),
        }
    )


@pytest.mark.parametrize(
    "shapes, message",
    [
        ((",".join(["1"] * 69 + ["5"]),), "70 dimensions, more than 32"),  # numpy: ValueError (over 64)
        (("5", "0,99999999999999999999"), "must be comma-separated integers"),  # numpy: ValueError
        (("5", f"0,{2**63 - 1}"), "beyond"),  # numpy: "Maximum allowed dimension exceeded"
        (("5", "0,4294967296,4294967296"), "beyond"),  # numpy: "array is too big"
        (("5", "0,1" + "0" * 5000), "must be comma-separated integers"),
        (("5", "٥"), "must be comma-separated integers"),  # int() takes other scripts' digits
        (("5", " 0"), "must be comma-separated integers"),
    ],
)
def test_a_shape_numpy_would_refuse_is_a_packing_error(shapes, message):
    with pytest.raises(packing.PackingError, match=f"node 7: packed record 'arrays': .*{message}"):
        packing.unpack(packed(*shapes), "node 7")


def test_shapes_models_have_still_restore():
    restored = packing.unpack(packed("", "1,1,0,3", ",".join(["1"] * 31 + ["4"]), values=5), "node 7")["arrays"]
    assert [tuple(restored[k].shape) for k in ("k0", "k1", "k2")] == [(), (1, 1, 0, 3), (1,) * 31 + (4,)]


def test_a_reason_becomes_one_short_printable_line_without_reading_all_of_it():
    forged = "INFO : round 3 done: seen accuracy 0.999"
    reason = f"oops\n{forged}\r\n\x1b[2K\x1b[1;32m{forged}\x1b[0m\x1b]0;title\x07\u202e\x00" + "x" * 20_000_000
    line = protocol.one_line(reason)
    assert line.startswith(f"oops {forged} {forged}??") and line.endswith(f"... (cut from {len(reason)} characters)")
    assert line.isprintable() and len(line) == protocol.REASON_CHARS
    assert protocol.one_line(line) == line  # a clean line stays as it is
    assert protocol.one_line("a\tb \n\n c") == "a b c" and protocol.one_line(5) == "5"
