import re
from pathlib import Path

import pytest
import torch

from florist.common.models import INPUTS, MODEL_NAMES, build_model, megabytes

DOCS = Path(__file__).parents[2] / "docs" / "models.md"

SHAPES = {"cnn": (1, 8, 8), "cnn-wide": (1, 8, 8), "lenet": (1, 28, 28), "mlp": (64,), "mobilenet_v2": (3, 32, 32)}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_is_head_of_features(name):
    torch.manual_seed(0)
    model = build_model(name, SHAPES[name], 10).eval()
    x = torch.randn(4, *SHAPES[name])
    features = model.features(x)
    assert features.ndim == 2 and features.shape[0] == 4
    assert torch.allclose(model(x), model.head(features))
    assert model(x).shape == (4, 10)


def test_lenet_matches_the_paper_layers():
    model = build_model("lenet", (3, 32, 32), 10)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(c.out_channels, c.kernel_size) for c in convs] == [(16, (5, 5)), (32, (5, 5))]
    assert [lin.out_features for lin in linears] == [120, 84, 10]
    assert build_model("lenet", (1, 28, 28), 10).features(torch.zeros(1, 1, 28, 28)).shape == (1, 84)


def test_mobilenet_has_over_a_million_parameters():
    assert sum(p.numel() for p in build_model("mobilenet_v2", (3, 32, 32), 10).parameters()) > 1_000_000


@pytest.mark.parametrize("name, shape", [("lenet", (1, 8, 8)), ("mobilenet_v2", (1, 32, 32)), ("resnet", (1, 8, 8))])
def test_unsupported_inputs_are_named(name, shape):
    with pytest.raises(ValueError, match=name):
        build_model(name, shape, 10)


def test_cnn_wide_is_the_cnn_with_twice_the_width():
    count = lambda name: sum(p.numel() for p in build_model(name, (1, 8, 8), 10).parameters())  # noqa: E731
    assert count("cnn-wide") > 3 * count("cnn")
    assert build_model("cnn-wide", (1, 8, 8), 10).features(torch.zeros(1, 1, 8, 8)).shape == (1, 256)


# Per model: the documented sizes at their edges (each must build and run), and one input outside
# with the one-line remedy its refusal must name.
FITTING = {
    "cnn": [(1, 8, 8), (1, 28, 28), (3, 32, 32), (3, 8, 32)],
    "cnn-wide": [(1, 8, 8), (3, 32, 32)],
    "lenet": [(1, 28, 28), (3, 32, 32)],
    "mlp": [(60,), (1, 8, 8), (3, 32, 32)],
    "mobilenet_v2": [(3, 32, 32), (3, 64, 64), (3, 32, 96)],
}
REFUSED = [
    ("cnn", (3, 64, 64), "use image-size=32,32 (image folders) or model=mobilenet_v2"),
    ("cnn", (1, 4, 4), "use image-size=8,8 (image folders) or model=mlp"),
    ("cnn-wide", (3, 33, 32), "use image-size=32,32 (image folders) or model=mobilenet_v2"),
    ("lenet", (1, 8, 8), "use image-size=28,28 (image folders) or one of model=cnn, cnn-wide, mlp"),
    ("mlp", (3, 64, 64), "use image-size=32,32 (image folders) or model=mobilenet_v2"),
    ("mlp", (5000,), "no built-in model takes it"),
    ("mobilenet_v2", (1, 28, 28), "use one of model=cnn, cnn-wide, lenet, mlp"),
    ("mobilenet_v2", (3, 16, 64), "use image-size=32,64 (image folders) or model=mlp"),
]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_each_model_takes_its_documented_sizes(name):
    assert set(FITTING) == set(MODEL_NAMES)
    for shape in FITTING[name]:
        assert INPUTS[name].accepts(shape)
        assert build_model(name, shape, 10).eval()(torch.zeros(2, *shape)).shape == (2, 10)


@pytest.mark.parametrize("name, shape, fix", REFUSED)
def test_a_misfit_is_refused_in_one_line_naming_what_fits(name, shape, fix):
    with pytest.raises(ValueError) as refused:
        build_model(name, shape, 10)
    message = str(refused.value)
    assert message == f"model {name!r} takes {INPUTS[name]}; got {'×'.join(map(str, shape))}: {fix}"
    for resized in re.findall(r"image-size=(\d+),(\d+)", message):  # what it suggests does fit
        assert INPUTS[name].accepts((shape[0], *map(int, resized)))
    for other in re.findall(r"(?:model=|, )([\w-]+)", fix):
        assert INPUTS[other].accepts(shape)


def test_the_docs_table_states_the_inputs_and_weights_models_py_has():
    """docs/models.md's table: each model's inputs as `INPUTS` states them, and each weight
    figure as the model measures at that shape."""
    section = DOCS.read_text().split("## Inputs each model takes")[1].split("\n## ")[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")][1:]  # no header
    table = {cells[0].strip("|` "): cells for cells in rows}
    assert list(table) == list(MODEL_NAMES)
    for name, (_, inputs, weights, _why) in table.items():
        assert inputs == str(INPUTS[name])
        figures = re.findall(r"([\d.]+ MB) at ([\d×]+)", weights)
        assert figures, name
        for stated, shape in figures:
            state = build_model(name, tuple(map(int, shape.split("×"))), 10).state_dict()
            assert stated == megabytes(sum(t.numel() * t.element_size() for t in state.values())), (name, shape)
