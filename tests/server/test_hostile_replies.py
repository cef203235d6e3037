"""A reply can at worst leave its own node out. In-process federations of five nodes (embedded
digits, iid, an MLP, robust `median`) in which partition 0 rewrites its replies as they leave
the node, after florist's ClientApp packed them: a packed record whose sizes add up but whose
shape numpy refuses (more than 64 dimensions, a dimension beyond 2**63), in its `train` replies
or in an extra record of its `query.info` reply; or an error reply whose reason is 20 MB of
text with line breaks and terminal escapes that would forge a log line. Each run completes,
that node is named with a one-line reason, and what the run writes stays small and clean."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message
from flwr.common.constant import ErrorCode

from florist.apps.client import app as client_app
from florist.common import packing, protocol
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process

HOSTILE = 100  # node id of partition 0 in the in-process grid
ROUNDS = 3
FORGED = "INFO : round 3 done: seen accuracy 0.999"
# 20 MB, a forged log line on a line of its own, escapes that would clear and colour a terminal line.
REASON = "\n" + FORGED + "\r\n\x1b[2K\x1b[1;32m" + FORGED + "\x1b[0m\n" + "x" * (20 * 10**6)


class Hostile:
    """florist's ClientApp, but node `HOSTILE` rewrites its replies of `message_type` with
    `spoil` on their way out (after `frame` packed them: a client mod sees them unpacked)."""

    def __init__(self, message_type: str, spoil: Callable[[Message, Message], Message]):
        self.message_type, self.spoil = message_type, spoil

    def __call__(self, msg: Message, context: Context) -> Message:
        reply = client_app(msg, context)
        if context.node_id == HOSTILE and msg.metadata.message_type == self.message_type:
            return self.spoil(msg, reply)
        return reply


def deep_shape(msg: Message, reply: Message) -> Message:
    """The packed model's first array declared with 70 dimensions of the same size."""
    layout = reply.content[protocol.ARRAYS + packing.LAYOUT]
    shapes = list(layout["shapes"])
    shapes[0] = ",".join(["1"] * 69 + [str(math.prod(int(d) for d in shapes[0].split(",")))])
    layout["shapes"] = shapes
    return reply


def huge_dimension(msg: Message, reply: Message) -> Message:
    """An extra packed record with an empty array of shape (0, 10**20): sizes add up to 3."""
    reply.content["extra"] = ArrayRecord({"float32": Array(np.zeros(3, np.float32))})
    reply.content["extra" + packing.LAYOUT] = ConfigRecord(
        {"keys": ["a", "b"], "dtypes": ["float32", "float32"], "shapes": ["3", "0,99999999999999999999"]}
    )
    return reply


def crafted_error(msg: Message, reply: Message) -> Message:
    return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, REASON), reply_to=msg)


def run(tmp_path: Path, message_type: str, spoil) -> dict:
    cfg = RunConfig.from_mapping(
        {
            "num-server-rounds": ROUNDS,
            "model": "mlp",
            "partition": "iid",
            "unseen-fraction": 0.0,
            "min-nodes": 5,
            "seed": 1,
            "aggregation": "median",
            "results-dir": str(tmp_path),
        }
    )
    return run_in_process(cfg, 5, client_app=Hostile(message_type, spoil))


def assert_left_out(results: dict, message_type: str, rounds: list[int], reason: str) -> None:
    """The run completed, and only the hostile node failed: in `rounds` of `message_type`, named,
    with a one-line reason that says `reason`."""
    assert results["complete"] and len(results["rounds"]) == ROUNDS
    failures = results["failures"]
    assert [(f["node_id"], f["message_type"], f["round"]) for f in failures] == [
        (HOSTILE, message_type, r) for r in rounds
    ]
    for failure in failures:
        assert failure["node"].startswith(f"node {HOSTILE}")  # with its key, once discovery gave it
        assert reason in failure["reason"] and failure["reason"].isprintable(), failure["reason"][:500]
        assert len(failure["reason"]) <= protocol.REASON_CHARS


@pytest.mark.parametrize(
    "message_type, spoil, rounds, reason",
    [
        ("train", deep_shape, list(range(1, ROUNDS + 1)), "70 dimensions, more than 32"),
        ("query.info", huge_dimension, [0], "the shape of 'b' must be comma-separated integers"),
    ],
    ids=["train-70-dims", "info-huge-dim"],
)
def test_a_packed_shape_numpy_refuses_leaves_its_node_out_and_the_run_completes(
    tmp_path, message_type, spoil, rounds, reason
):
    results = run(tmp_path, message_type, spoil)
    assert_left_out(results, message_type, rounds, reason)
    scored = {c["client"] for c in results["clients"] if c["accuracy"] is not None}
    assert scored >= {f"partition-{i}" for i in range(1, 5)}


def test_an_error_reason_of_20_mb_with_line_breaks_and_escapes_is_kept_as_one_short_clean_line(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="flwr"):
        results = run(tmp_path, "train", crafted_error)
    assert_left_out(results, "train", list(range(1, ROUNDS + 1)), "error code 2: INFO : round 3 done")
    assert "cut from 20000" in results["failures"][0]["reason"]
    for name in ("results.json", "report.md", "checkpoint.pt"):
        written = (tmp_path / name).read_bytes()
        assert len(written) < 2 * 10**6, f"{name}: {len(written)} bytes"
        assert b"x" * 1000 not in written and b"\n" + FORGED.encode() not in written, name
        assert b"\x1b" not in written or name == "checkpoint.pt", name  # its tensors may hold any byte
    report = (tmp_path / "report.md").read_text()
    assert not any(line.startswith(FORGED) for line in report.splitlines())
    logged = [r.getMessage() for r in caplog.records if "left out of train" in r.getMessage()]
    assert len(logged) == ROUNDS
    assert all(m.isprintable() and len(m) < 2 * protocol.REASON_CHARS for m in logged), logged[0][:500]
