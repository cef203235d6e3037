"""A hostile server can neither make a node read a folder of its choosing, nor learn the node's
paths, files, labels or devices from its errors, nor make it allocate, work or take threads
without bound (client/guard.py).
Messages go through florist's real ClientApp (`InProcessGrid`: serialized both ways)."""

import logging
import sys
import time

import numpy as np
import pytest
from flwr.app import DEFAULT_TTL, ArrayRecord, Message

from florist.apps.client import app
from florist.client import guard
from florist.common import data as data_lib
from florist.common import devices, protocol
from florist.common.models import seeded_model
from florist.common.protocol import message_config
from florist.common.spec import INFO
from florist.config import RunConfig
from florist.runners.inprocess import InProcessGrid, server_identity
from florist.runners.simulation import simulate
from florist.strategies.fedavg.spec import TRAIN
from florist.strategies.perfedckt.spec import EVALUATE_CKT, TRAIN_CKT

PARTITION = {"partition-id": 0, "num-partitions": 5}
OPENED: list[str] = []  # files and folders opened or listed under `_WATCHED[0]`
_WATCHED: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if _WATCHED and event in ("open", "os.listdir", "os.scandir") and str(args[0]).startswith(_WATCHED[0]):
        OPENED.append(f"{event} {args[0]}")


sys.addaudithook(_audit)  # for the whole session (a hook cannot be removed): inert unless a test watches


@pytest.fixture
def watch(tmp_path):
    """What the node opens or lists under `tmp_path / "node-disk"` during the test."""
    disk = tmp_path / "node-disk"
    disk.mkdir()
    OPENED.clear()
    _WATCHED[:] = [str(disk)]
    yield disk
    _WATCHED.clear()


@pytest.fixture(autouse=True)
def untrusting(monkeypatch):
    """Nodes as a deployment starts them: nothing in the environment lets them take the server's paths."""
    monkeypatch.delenv(guard.TRUSTED_SERVER_ENV, raising=False)


@pytest.fixture(scope="module")
def parquet_folder(tmp_path_factory):
    """200 digits as 8×8 PNGs with labels, in a folder `datasets.load_dataset` reads."""
    from datasets import ClassLabel, Dataset, Features, Image

    x, y = data_lib.load_digits()
    images = [(im[0] * 255).astype(np.uint8) for im in x[:200]]
    folder = tmp_path_factory.mktemp("parquet")
    features = Features({"image": Image(), "label": ClassLabel(num_classes=10)})
    Dataset.from_dict({"image": images, "label": y[:200].tolist()}, features=features).to_parquet(
        str(folder / "train.parquet")
    )
    return folder


def _send(node_config, exchange=INFO, ttl=None, arrays=None, raw=None, request=None, **values) -> Message:
    """The reply of one node (`PARTITION` with `node_config`) to one message of florist's server
    carrying the run config `values`, the exchange's own settings `request`, and `raw`
    settings, sent as they are."""
    grid = InProcessGrid(app, [PARTITION | node_config])
    cfg = RunConfig.from_mapping({"partition": "iid"} | values)
    config = message_config(cfg, exchange, 1, grid.run_id, **(request or {})) | (raw or {})
    content = protocol.content(arrays, config=config)
    with server_identity(grid.run_id):
        msg = Message(content, dst_node_id=100, message_type=exchange.message_type, ttl=ttl)
        [reply] = grid.send_and_receive([msg])
    return reply


def _model(values=None) -> ArrayRecord:
    cfg = RunConfig.from_mapping(values or {})
    return protocol.to_record(seeded_model(cfg.model, (1, 8, 8), cfg.num_classes, cfg.seed))


def test_a_server_naming_a_folder_dataset_is_refused_and_the_node_reads_nothing(watch):
    (watch / "train.parquet").write_bytes(b"not read")
    OPENED.clear()  # from here on, the node's reads
    replies = [_send({}, raw={"dataset": str(folder)}) for folder in (watch, watch / "absent")]
    expected = (
        "Refused in query.info: node partition-0: the server names a local folder for dataset; a node reads "
        "folders only from its own --node-config (set dataset=... there)"
    )
    # The same reply whether the folder is there or not: the server learns nothing about the disk.
    assert [r.error.reason for r in replies] == [expected] * 2
    relative = _send({}, raw={"dataset": "../node-disk"})  # an OWNER/NAME look-alike that is a path
    assert relative.has_error() and "local folder for dataset" in relative.error.reason
    assert OPENED == []


def test_a_server_naming_a_public_dir_the_node_config_does_not_set_is_refused(watch):
    np.savez(watch / "public.npz", x=data_lib.load_digits()[0][:50])
    OPENED.clear()  # from here on, the node's reads
    reply = _send({}, TRAIN_CKT, strategy="perfed-ckt", **{"public-dir": str(watch)})
    assert reply.error.reason.startswith("Refused in train.ckt: node partition-0: the server names a local folder")
    assert "(set public-dir=... there)" in reply.error.reason and OPENED == []


def test_the_node_configs_folder_dataset_wins_over_the_servers_choice(parquet_folder):
    reply = _send({"dataset": str(parquet_folder)}, dataset="digits")
    assert not reply.has_error(), reply.error.reason
    metrics = reply.content[protocol.METRICS]
    assert metrics["num-train"] + metrics["num-val"] + metrics["num-test"] == 200 // 5  # the folder's, not the digits'


def test_a_wrong_public_dir_of_the_node_is_logged_there_and_the_server_sees_no_path_or_listing(watch, caplog):
    for name in ("alpha-secret", "beta-secret"):  # class folders without images: ImageFolder lists them
        (watch / name).mkdir()
        (watch / name / "notes.txt").write_text("x")
    with caplog.at_level(logging.ERROR):
        reply = _send({"public-dir": str(watch)}, TRAIN_CKT, strategy="perfed-ckt")
    reason = reply.error.reason
    assert reason.startswith("ValueError in train.ckt: ") and "ImageFolder tree" in reason
    assert "node-disk" not in reason and "secret" not in reason and "/" not in reason and "\n" not in reason
    logged = caplog.text
    assert str(watch) in logged and "alpha-secret" in logged  # the node's operator gets the details


def test_too_many_classes_are_refused_before_anything_is_allocated():
    expected = (
        "Refused in train: node partition-0: the server asks for num-classes {}, over this node's cap of {} classes "
        "(raise node-max-classes in its --node-config)"
    )
    start = time.monotonic()
    reply = _send({}, TRAIN, arrays=_model(), **{"num-classes": 10**9})  # unrefused: a 512 GB output layer
    # the bound only ends a hung run (a loaded machine takes seconds): unrefused, the layer would be allocated
    assert reply.error.reason == expected.format(10**9, 1000) and time.monotonic() - start < 60
    assert _send({"node-max-classes": 5}, TRAIN, arrays=_model()).error.reason == expected.format(10, 5)
    trained = _send({"node-max-classes": 10}, TRAIN, arrays=_model())  # at the cap
    assert not trained.has_error() and protocol.ARRAYS in trained.content.array_records


def test_more_local_steps_than_the_nodes_cap_are_refused_before_training():
    # A partition of 1/5 of the digits' training rows, batches of 16: far more than 3 steps an epoch.
    reply = _send({"node-max-steps": 3}, TRAIN, arrays=_model())
    assert reply.error.reason.startswith("Refused in train: node partition-0: the server asks for ")
    assert reply.error.reason.endswith(
        "local steps, over this node's cap of 3 (raise node-max-steps in its --node-config)"
    )
    assert not _send(
        {"node-max-steps": 3}, TRAIN, arrays=_model(), **{"local-epochs": 1, "batch-size": 4096}
    ).has_error()
    # PerFed-CKT trains a node it never sampled for `scratch-rounds` rounds: all count, refused before the first.
    ckt = {"strategy": "perfed-ckt", "ckt-steps": 50}
    scratch = _send({"node-max-steps": 100}, EVALUATE_CKT, request={"scratch_rounds": 3}, **ckt).error.reason
    assert scratch.startswith("Refused in evaluate.ckt: node partition-0: the server asks for 150 local steps, over")


def test_a_batch_size_over_the_nodes_cap_is_refused_in_one_line():
    expected = (
        "Refused in train: node partition-0: the server asks for batch-size {}, over this node's cap of {} "
        "(raise node-max-batch-size in its --node-config)"
    )
    assert _send({}, TRAIN, arrays=_model(), **{"batch-size": 4097}).error.reason == expected.format(4097, 4096)
    assert _send({"node-max-batch-size": 8}, TRAIN, arrays=_model()).error.reason == expected.format(16, 8)
    assert not _send({"node-max-batch-size": 16}, TRAIN, arrays=_model()).has_error()  # at the cap


@pytest.fixture
def threads_set(monkeypatch):
    """The torch thread counts the node's handlers set, on a node with 2 cores (none is set here)."""
    counts: list[int] = []
    monkeypatch.setattr(devices, "set_torch_threads", counts.append)
    monkeypatch.setattr(devices, "usable_cores", lambda: 2)
    return counts


def test_the_servers_torch_threads_are_cut_to_the_nodes_cores(threads_set):
    for node_config in ({}, {"node-max-threads": 1}, {"torch-threads": 3}, {"trusted-server": True}):
        assert not _send(node_config, **{"torch-threads": 8}).has_error()
    assert threads_set == [2, 1, 3, 8]  # the node's own setting and a trusted server's are taken as they are
    assert not _send({}, **{"torch-threads": 0}).has_error() and threads_set[-1] == 0  # 0: as many as it has
    assert not _send({"node-max-threads": 1}, **{"torch-threads": 0}).has_error() and threads_set[-1] == 1  # its cap
    with pytest.raises(ValueError, match=r"torch-threads must be in \[0, 1024\]"):
        RunConfig.from_mapping({"torch-threads": 1e9})


def test_a_device_from_the_server_is_ignored_and_its_absence_tells_the_server_nothing():
    auto = str(devices.resolve("auto"))
    for device in ("cuda:7", "mps", "cpu"):
        reply = _send({}, device=device)  # refused before, naming what the machine has
        assert not reply.has_error() and reply.content[protocol.CONFIG]["device"] == auto
    assert _send({"device": "cpu"}, device="cuda:7").content[protocol.CONFIG]["device"] == "cpu"  # the node's own
    trusted = _send({"trusted-server": True}, device="cuda:7").error.reason
    assert trusted.startswith("ValueError in query.info: node partition-0: device 'cuda:7' is not available")


def test_a_wrong_typed_server_value_is_refused_in_one_line_even_where_the_node_sets_its_own():
    """The server's whole config is type-checked before the node's values replace any of it: a
    malformed message is refused, not half-taken because the node happened to override the key."""
    for key, node_value, sent in (("keep-models", 3, "all"), ("models-root", "/mine", 7), ("device", "cpu", 0)):
        reason = _send({key: node_value}, raw={key: sent}).error.reason
        assert reason == (
            f"ValueError in query.info: node partition-0: the server's run-config key {key!r} expects "
            f"{type(node_value).__name__}, got {sent!r} ({type(sent).__name__})"
        )
    assert not _send({"keep-models": 3}, raw={"keep-models": 100}).has_error()  # well typed: the node's own wins


def test_a_label_range_error_tells_the_server_not_which_labels_the_node_holds(tmp_path, caplog):
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        np.savez(tmp_path / f"{split}.npz", x=rng.random((40, 8, 8), dtype="float32"), y=np.arange(40) % 10)
    with caplog.at_level(logging.ERROR):
        reason = _send({"data-dir": str(tmp_path)}, **{"num-classes": 7}).error.reason
    assert reason == "ValueError in query.info: … the labels do not fit num-classes 7 (0 to 6)"
    assert "labels [7, 8, 9] are outside [0, 7)" in caplog.text  # the node's operator gets the details


def test_a_deadline_beyond_the_nodes_cap_is_refused():
    expected = (
        "Refused in query.info: node partition-0: the server asks for a deadline of {} s, over this node's cap of "
        "{} s (raise node-max-seconds in its --node-config)"
    )
    assert _send({}, ttl=7200.0).error.reason == expected.format(7200, 3600)
    assert _send({"node-max-seconds": 60}, ttl=600.0).error.reason == expected.format(600, 60)
    assert not _send({"node-max-seconds": 60}, ttl=60.0).has_error()  # at the cap
    assert not _send({"node-max-seconds": 60}, ttl=DEFAULT_TTL).has_error()  # Flower's default, no request: cut


def test_a_bad_cap_in_the_node_config_is_named():
    reply = _send({"node-max-steps": 0})
    assert (
        reply.error.reason == "ValueError in query.info: node-config key 'node-max-steps' must be a number > 0, got 0"
    )


def test_the_short_reason_keeps_no_path_no_listing_and_one_short_line():
    text = "cannot read '/home/a b/x.npz' nor C:\\data\\y or ~/z:\n found ['a', 'b', 'c', 'd'] in [1, 2]" + "!" * 300
    reason = guard.short_reason(text)
    assert reason.startswith("cannot read '…' nor … or … found [4 items] in [1, 2]!")
    assert len(reason) == guard.REASON_CHARS and reason.endswith("…") and "\n" not in reason


def test_the_users_own_simulation_still_reads_the_folder_dataset_it_names(parquet_folder, tmp_path):
    """Flower's simulation builds its nodes' configs: its Ray workers get FLORIST_TRUSTED_SERVER
    from `simulate`. (The in-process runner's nodes have `trusted-server = true`: covered by
    tests/common/test_hub.py::test_a_run_on_a_folder_dataset_completes.)"""
    values = {"dataset": str(parquet_folder), "partition": "iid", "num-server-rounds": 1, "min-nodes": 2}
    results = simulate(RunConfig.from_mapping(values | {"results-dir": str(tmp_path)}), 2)
    assert results["complete"] and not results["failures"] and len(results["clients"]) == 2


def test_a_node_that_trusts_its_server_takes_its_folders_and_requests_but_its_own_caps(watch):
    """florist's own one-user runs (client/guard.py): the server is the user."""
    trusted = {"trusted-server": True}
    assert not _send(trusted, ttl=7200.0, **{"num-classes": 2000}).has_error()
    refused = _send(trusted | {"node-max-seconds": 60}, ttl=600.0).error.reason
    assert refused.endswith("over this node's cap of 60 s (raise node-max-seconds in its --node-config)")
    missing = _send(trusted, raw={"dataset": str(watch / "absent")})  # read as the folder it names
    reason = missing.error.reason
    assert reason.startswith("ValueError in query.info: invalid run config: dataset '") and "no such folder" in reason
