import pytest
import torch

from florist.common import protocol
from florist.common.models import build_model


def test_model_record_round_trip_is_exact():
    model = build_model("cnn", (1, 8, 8), 10)
    record = protocol.to_record(model)
    state = protocol.state_of(record, model.state_dict(), "test")
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_mobilenet_round_trip_keeps_integer_buffers():
    model = build_model("mobilenet_v2", (3, 32, 32), 10)
    state = protocol.state_of(protocol.to_record(model), model.state_dict(), "test")
    counters = [k for k in state if k.endswith("num_batches_tracked")]
    assert counters and all(state[k].dtype == torch.int64 for k in counters)


def test_wrong_shape_and_nan_are_refused_with_the_source():
    reference = build_model("cnn", (1, 8, 8), 10).state_dict()
    bad = dict(reference) | {"head.weight": torch.zeros(3, 3)}
    with pytest.raises(
        protocol.ProtocolError, match=r"node 7: array 'head.weight' has shape \(3, 3\), expected \(10, 128\)"
    ):
        protocol.state_of(protocol.ArrayRecord(bad), reference, "node 7")
    nan = dict(reference) | {"head.bias": torch.full((10,), float("nan"))}
    with pytest.raises(protocol.ProtocolError, match="'head.bias' contains NaN"):
        protocol.state_of(protocol.ArrayRecord(nan), reference, "node 7")
    with pytest.raises(protocol.ProtocolError, match="missing"):
        protocol.state_of(protocol.ArrayRecord({"head.bias": reference["head.bias"]}), reference, "node 7")


def test_other_dtypes_are_refused_unless_converting_for_flowers_strategies():
    """Florist's servers send the model's own dtypes; Flower's FedAdam sends float64 after its
    arithmetic, which a node converts, checking values before (1e300 would become Inf) and after."""
    reference = build_model("cnn", (1, 8, 8), 10).state_dict()
    wide = {k: v.double() if v.is_floating_point() else v for k, v in reference.items()}
    with pytest.raises(protocol.ProtocolError, match=r"dtype torch.float64, expected torch.float32"):
        protocol.state_of(protocol.ArrayRecord(wide), reference, "node 2")
    state = protocol.state_of(protocol.ArrayRecord(wide), reference, "node 2", convert=True)
    assert all(state[k].dtype == v.dtype and torch.equal(state[k], v) for k, v in reference.items())
    huge = dict(wide) | {"head.bias": torch.full((10,), 1e300, dtype=torch.float64)}
    with pytest.raises(protocol.ProtocolError, match="'head.bias' has values beyond"):
        protocol.state_of(protocol.ArrayRecord(huge), reference, "node 2", convert=True)


def test_metrics_must_be_present_and_finite():
    reply = protocol.content(metrics={"accuracy": float("inf"), "num-examples": 3})
    with pytest.raises(protocol.ProtocolError, match="'accuracy' is missing or not a finite number"):
        protocol.metrics_of(reply, ("accuracy",), "node 1")
    with pytest.raises(protocol.ProtocolError, match="no 'metrics'"):
        protocol.metrics_of(protocol.content(config={"a": 1}), ("accuracy",), "node 1")


def test_nbytes_counts_the_payload():
    small = protocol.content(protocol.to_record(build_model("mlp", (4,), 2)))
    large = protocol.content(protocol.to_record(build_model("cnn", (1, 8, 8), 10)))
    params = sum(p.numel() for p in build_model("cnn", (1, 8, 8), 10).parameters())
    assert protocol.nbytes(small) < protocol.nbytes(large)
    assert 4 * params <= protocol.nbytes(large) < 4 * params * 1.05  # float32 plus a little framing


@pytest.mark.parametrize(
    "value, refusal",
    [
        (float("nan"), "contains NaN or Inf"),
        (-float("inf"), "contains NaN or Inf"),
        (-2e9, r"has values beyond ±1e\+09"),
        (1e9, None),  # the bound itself passes
    ],
)
def test_one_bad_value_among_finite_ones_is_refused_by_what_it_is(value, refusal):
    reference = {"w": torch.zeros(70_000), "empty": torch.zeros(0)}
    sent = {"w": torch.ones(70_000), "empty": torch.zeros(0)}
    sent["w"][12_345] = value
    if refusal is None:
        assert protocol.state_of(protocol.ArrayRecord(sent), reference, "node 7")["w"][12_345] == value
        return
    with pytest.raises(protocol.ProtocolError, match=f"node 7: array 'w' {refusal}"):
        protocol.state_of(protocol.ArrayRecord(sent), reference, "node 7")


def test_what_a_node_says_of_its_data_is_bounded_text_or_refused():
    """A node chooses the names it sends at discovery: they reach report.md as one-line text, cut in
    length and number; a wrong type is an ill-formed reply."""
    said = {
        protocol.DATA_SOURCE: "folder \x1b[31mred\n",
        protocol.CLASS_NAMES: ["x" * 500, "b"],
        protocol.SKIPPED_FILES: [f"f{i}.png" for i in range(100)],
    }
    data = protocol.data_of(protocol.content(config=said), "node 7")
    assert data[protocol.DATA_SOURCE] == "folder red"
    assert len(data[protocol.CLASS_NAMES][0]) == protocol.NAME_CHARS and data[protocol.CLASS_NAMES][1] == "b"
    assert data[protocol.SKIPPED_FILES] == [f"f{i}.png" for i in range(protocol.MAX_NAMED_FILES)]
    assert protocol.data_of(protocol.content(config={}), "node 7") == {}  # an earlier florist's node
    with pytest.raises(protocol.ProtocolError, match="node 7: class-names must be a list of strings"):
        protocol.data_of(protocol.content(config={protocol.CLASS_NAMES: [1, 2]}), "node 7")
