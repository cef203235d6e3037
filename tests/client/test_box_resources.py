"""A box's disk and memory are its own: whatever a server it does not trust sends, the node
decodes no image larger than its pixel cap, caches its folder once per image size within a
bound, and keeps the models of its last `keep-models` runs (client/guard.py, client/personal.py,
common/datacache.py). Messages go through florist's real ClientApp (`InProcessGrid`)."""

import logging

import numpy as np
import pytest
from flwr.app import Message
from PIL import Image

from florist.apps.client import app
from florist.client import guard, personal
from florist.common import protocol
from florist.common.models import seeded_model
from florist.common.protocol import message_config
from florist.common.spec import INFO
from florist.config import RunConfig
from florist.runners.inprocess import InProcessGrid, server_identity
from florist.strategies.fedavg.spec import EVALUATE


@pytest.fixture(autouse=True)
def box(tmp_path, monkeypatch):
    """A node's own disk: its cache under `tmp_path`, and no trust in its server."""
    monkeypatch.delenv(guard.TRUSTED_SERVER_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _folder(root, count=40):
    """`count` 8×8 grayscale PNGs in two class folders, as the red-team box held."""
    rng = np.random.default_rng(0)
    for i in range(count):
        (root / f"class{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(root / f"class{i % 2}" / f"{i}.png")
    return root


def _send(node_config, exchange=INFO, **values) -> Message:
    """One node's reply to one message of a new Flower run (a random run id) carrying `values`."""
    grid = InProcessGrid(app, [node_config])
    cfg = RunConfig.from_mapping({"num-classes": 2} | values)
    arrays = None
    if exchange == EVALUATE:
        size = cfg.image_size.split(",") if cfg.image_size else (8, 8)
        arrays = protocol.to_record(seeded_model(cfg.model, (1, *map(int, size)), 2, cfg.seed))
    config = message_config(cfg, exchange, cfg.num_server_rounds + 1, grid.run_id)  # the final evaluation
    with server_identity(grid.run_id):
        [reply] = grid.send_and_receive(
            [Message(protocol.content(arrays, config=config), dst_node_id=100, message_type=exchange.message_type)]
        )
    return reply


def _entries(tmp_path):
    data = tmp_path / "cache" / "florist" / "data"
    return sorted(p for p in data.iterdir() if p.is_dir()) if data.is_dir() else []


def test_an_image_size_over_the_pixel_cap_is_refused_in_one_line_before_anything_is_decoded(tmp_path):
    node = {"data-dir": str(_folder(tmp_path / "own", count=3)), "state-dir": str(tmp_path / "state")}
    reply = _send(node, **{"image-size": "4096,4096"})
    assert reply.has_error()
    assert reply.error.reason.endswith(
        "the server asks for image-size 4096,4096 (16777216 pixels), over this node's cap of 1048576 pixels "
        "(raise node-max-pixels in its --node-config)"
    )
    assert "\n" not in reply.error.reason and _entries(tmp_path) == []
    assert not _send(node | {"node-max-pixels": 16, "image-size": "4,4"}).has_error()  # its own choice is its own


def test_twenty_messages_leave_one_cache_entry_per_image_size_and_the_last_runs_models(tmp_path):
    node = {"data-dir": str(_folder(tmp_path / "own")), "state-dir": str(tmp_path / "state"), "keep-models": 3}
    for i in range(20):
        values = {"seed": i, "val-fraction": 0.1 + i / 100, "image-size": ("", "12,12")[i % 2], "keep-models": 100}
        reply = _send(node, EVALUATE, **values)
        assert not reply.has_error(), reply.error.reason
    assert len(_entries(tmp_path)) == 2  # one per image size, whatever the seeds and fractions
    [key] = personal.nodes_keeping_models(tmp_path / "state")[1]
    assert len(personal.kept_models(tmp_path / "state", key)) == 3  # the node's count, not the server's 100
    assert personal.footprint(tmp_path / "state" / key).endswith("MB, the models of 3 runs")  # florist join's line


def test_the_cache_stays_within_its_bound_least_recently_read_out_first_said_in_the_log(tmp_path, caplog):
    node = {"data-dir": str(_folder(tmp_path / "own")), "node-max-cache-mb": 0.012}  # room for one 16×16 entry
    with caplog.at_level(logging.INFO, logger="flwr"):  # another test may have left Flower's logger quieter
        for size in ("16,16", "12,12", "16,16", "14,14"):
            assert not _send(node, **{"image-size": size}).has_error()
    [left] = _entries(tmp_path)
    assert sum(f.stat().st_size for f in left.rglob("*")) <= 0.012e6
    assert caplog.text.count("data cache over 0.012 MB: removed") >= 2
