"""The messages a new user meets first: a dataset folder that is not there, a key named as
another tool names it, and third-party warnings that say nothing to act on. Each message is
checked whole, as the one line `florist` prints."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from florist import cli
from florist.apps.server import OneLineStops
from florist.common import scenarios
from florist.common.key_hints import NUM_CLIENTS_HINT, NUM_CLIENTS_WORDS, SYNONYMS, WHERE_KEYS
from florist.config import SECTIONS, RunConfig

NO_FOLDER = "no such folder (" + scenarios.LOCAL_DATASET + ")"


def _error(capsys, *argv: str) -> str:
    """The one line `florist ARGV` prints on stderr, checked to fail as a user's mistake."""
    assert cli.main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("path", ["{tmp}/no/such/folder", "./missing", "../missing", "~/missing", "a/b/c"])
def test_a_dataset_path_that_is_no_folder_says_so(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    path = path.format(tmp=tmp_path)
    line = _error(capsys, "simulate", "--dataset", path)
    assert line == f"florist: error: invalid run config: dataset {path!r}: {NO_FOLDER}"


@pytest.mark.parametrize("path", ["train.csv", "data/train.csv"])  # the second is an OWNER/NAME look-alike
def test_a_dataset_that_names_a_file_says_it_is_not_a_folder(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / path).write_text("x,label\n1,0\n")
    line = _error(capsys, "simulate", "--dataset", path)
    assert line == f"florist: error: invalid run config: dataset {path!r}: not a folder ({scenarios.LOCAL_DATASET})"


def test_owner_name_is_a_hub_id_unless_it_is_a_folder_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert scenarios.parse_dataset("uoft-cs/cifar10") == ("hub", ())  # no such folder: the hub
    (tmp_path / "team" / "images").mkdir(parents=True)
    assert scenarios.parse_dataset("team/images") == ("hub", ())  # read by datasets.load_dataset as a folder
    assert scenarios.parse_dataset("~") == ("hub", ())
    with pytest.raises(ValueError, match="^dataset must be 'digits'"):
        scenarios.parse_dataset("cifar10")  # a bare word is not a path: every form is listed


@pytest.mark.parametrize(
    "key,hint",
    [
        ("learning-rate", "did you mean 'lr'?"),
        ("learning_rate", "did you mean 'lr'?"),
        ("epochs", "did you mean 'local-epochs'?"),
        ("rounds", "did you mean 'num-server-rounds'?"),
        ("batchsize", "did you mean 'batch-size'?"),
        ("batch", "did you mean 'batch-size'?"),
        ("seeds", "did you mean 'seed'?"),
        ("local_epochs", "did you mean 'local-epochs'?"),
        ("momentun", "did you mean 'momentum' or 'server-momentum'?"),
        ("datset", "did you mean 'dataset' or 'public-dataset'?"),
        ("zzzz", "no key is close"),
    ],
)
def test_an_unknown_key_gets_its_real_name_or_a_few_close_ones(key, hint, capsys):
    line = _error(capsys, "simulate", "--run-config", f"{key}=1")
    assert line == f"florist: error: unknown run-config key {key!r}; {hint} ({WHERE_KEYS})"


@pytest.mark.parametrize("key", ["clients", "num-clients", "num_supernodes"])
def test_the_number_of_clients_is_named_as_the_flag_it_is(key, capsys):
    line = _error(capsys, "simulate", "--run-config", f"{key}=5")
    assert line == f"florist: error: unknown run-config key {key!r}; {NUM_CLIENTS_HINT}"
    assert "--num-clients (simulate, compare)" in NUM_CLIENTS_HINT


def test_every_synonym_names_a_key_and_none_is_a_key_itself():
    """A synonym that became a key would never be reached; one whose key was renamed would
    send users to a key that is not there (and fall back to difflib silently)."""
    known = set(RunConfig.keys()).union(*(section.keys() for section in SECTIONS.values()))
    assert set(SYNONYMS.values()) <= known
    assert not (set(SYNONYMS) | NUM_CLIENTS_WORDS) & known


def _image_folder(root, classes: int = 3, per_class: int = 40):
    """`per_class` random 8×8 grayscale PNGs in each of `classes` class folders."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).save(root / f"class{c}" / f"{i}.png")
    return root


def test_a_folder_dataset_loads_without_dirichlet_retry_warnings(tmp_path, recwarn):
    """5 clients of 120 images at α = 0.3 miss min-partition-size on the first draw (seed 1):
    flwr-datasets warns a paragraph per miss, then the next draw succeeds. Every folder run
    loads its partitions this way."""
    cfg = RunConfig.from_mapping({"dataset": str(_image_folder(tmp_path / "images"))})
    assert len(scenarios.client_data(0, 5, cfg).y_train) > 0
    assert not [str(w.message)[:80] for w in recwarn if "min_partition_size" in str(w.message)]


def _logged(err: BaseException) -> logging.LogRecord:
    """The record Flower logs for a ServerApp that raised `err`, through florist's filter."""
    record = logging.LogRecord("flwr", logging.ERROR, __file__, 0, "%s raised an exception", ("ServerApp",), None)
    record.exc_info = (type(err), err, err.__traceback__)
    OneLineStops().filter(record)
    return record


def test_a_serverapp_stop_florist_explains_is_logged_in_one_line_and_a_bug_keeps_its_traceback():
    with pytest.raises(ValueError) as explained:
        RunConfig.from_mapping({"dp": "bogus"})  # raised in florist's own code, with what to change
    record = _logged(explained.value)
    assert record.exc_info is None and record.getMessage() == f"florist: error: {explained.value}"
    with pytest.raises(RuntimeError) as bug:
        torch.zeros(2) + torch.zeros(3)  # a RuntimeError raised inside torch: a bug to find
    record = _logged(bug.value)
    assert record.exc_info is not None and record.getMessage() == "ServerApp raised an exception"
