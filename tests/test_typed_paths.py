"""Every path a user types is made absolute where they typed it (issue 54): `deploy-local`'s
SuperLink, SuperNodes and `flwr run` work in folders of their own, where `--dataset ./myshapes`
named nothing."""

import os

import pytest

from florist.cli import build_parser
from florist.cli.options import launch


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A working folder holding the data folder `myshapes`."""
    (tmp_path / "myshapes").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    "argv",
    [
        ["deploy-local", "--dataset", "myshapes"],
        ["deploy-local", "--dataset", "./myshapes"],
        ["deploy-local", "--run-config", 'dataset="myshapes"'],
        ["simulate", "--dataset", "./myshapes"],
        ["compare", "--out", "o", "--dataset", "myshapes"],
    ],
)
def test_a_relative_dataset_folder_reaches_the_run_absolute(argv, elsewhere):
    args = build_parser().parse_args(argv)
    assert launch(args).values["dataset"] == str(elsewhere / "myshapes")


@pytest.mark.parametrize("name", ["digits", "synthetic:1,1", "uoft-cs/cifar10"])
def test_a_dataset_that_is_no_folder_here_stays_as_typed(name, elsewhere):
    assert launch(build_parser().parse_args(["simulate", "--dataset", name])).values["dataset"] == name


def test_a_preset_s_dataset_folder_is_made_absolute_too(elsewhere):
    args = build_parser().parse_args(["compare", "--out", "o"])
    assert launch(args, {"dataset": "./myshapes"}).values["dataset"] == str(elsewhere / "myshapes")


@pytest.mark.parametrize(
    ("argv", "dest"),
    [
        (["deploy-local", "--state-dir", "fed"], "state_dir"),
        (["local-federation", "--state-dir", "fed"], "state_dir"),
        (["local-federation"], "state_dir"),  # its default, ./florist-federation
        (["join", "--superlink", "h:1", "--data-dir", "box", "--state-dir", "fed"], "data_dir"),
        (["join", "--superlink", "h:1", "--data-dir", "box", "--state-dir", "fed"], "state_dir"),
        (["predict", "--data", "x.npz", "--state-dir", "fed"], "data"),
        (["predict", "--data", "x.npz", "--state-dir", "fed"], "state_dir"),
        (["export", "--out", "o", "--model", "m"], "model"),
        (["simulate", "--resume", "results/run"], "resume"),
        (["supernode", "--app-dir", "app"], "app_dir"),
    ],
)
def test_every_path_option_is_absolute(argv, dest, elsewhere):
    value = getattr(build_parser().parse_args(argv), dest)
    assert os.path.isabs(value) and value.startswith(str(elsewhere)), value
