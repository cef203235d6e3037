import pytest
import torch

from florist.common.models import MODEL_NAMES, build_model

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
