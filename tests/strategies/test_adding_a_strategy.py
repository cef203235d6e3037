"""docs/adding-a-strategy.md, followed literally: a toy strategy added to a copy of the checkout
(its folder, the lines in `florist/apps/` beside Local's, its keys in pyproject.toml) and run for
two rounds by `florist simulate`. The edits anchor on the lines the page quotes, so a page or a
file that drifts from the other fails here, naming the anchor.

The toy is Local with its own run-wide setting (`toy-epochs`, a `Settings` section with a prefix),
so that every step of the page, the config keys included, has something to do."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = (REPO / "docs" / "adding-a-strategy.md").read_text()

# Step 1: the spec (no torch), with a section whose prefix makes field `epochs` the key `toy-epochs`.
SPEC = '''"""Toy: Local with its own number of epochs per round."""

from __future__ import annotations

import dataclasses

from florist.common.settings import Settings, setting
from florist.common.spec import Exchange, StrategySpec


@dataclasses.dataclass(frozen=True)
class ToySettings(Settings):
    prefix = "toy"

    epochs: int = setting(1)


@dataclasses.dataclass(frozen=True)
class ScratchSettings(Settings):
    scratch_epochs: int = setting(1)


TRAIN_TOY = Exchange("train.toy")
EVALUATE_TOY = Exchange("evaluate.toy", ScratchSettings)

TOY = StrategySpec("toy", "Toy: Local with its own epochs", (TRAIN_TOY, EVALUATE_TOY), ToySettings)
'''

# Step 2: the server half, on `florist.server.strategy.ServerStrategy`.
SERVER = '''"""Toy's server half."""

from __future__ import annotations

from florist.server.strategy import TESTED, TRAINED, ServerStrategy, mean_loss, metrics_of
from florist.strategies.toy.spec import EVALUATE_TOY, TRAIN_TOY


class Toy(ServerStrategy):
    def train_round(self, server_round, nodes):
        replies = self.broadcast(TRAIN_TOY, nodes, server_round, self.request(TRAIN_TOY, server_round), TRAINED)
        return mean_loss(r.metrics for r in replies.values())

    def evaluate(self, server_round, nodes):
        budget = max(1, self.cfg.num_server_rounds * self.settings.epochs)
        request = self.request(EVALUATE_TOY, server_round, scratch_epochs=budget)
        return metrics_of(self.broadcast(EVALUATE_TOY, nodes, server_round, request, TESTED))
'''

# Step 3: the client half, one `(node, request) -> RecordDict` function per exchange.
CLIENT = '''"""Toy's client half: each node keeps its own model from round to round."""

from __future__ import annotations

import torch
from flwr.app import RecordDict

from florist.client.node import Node, Request
from florist.common import protocol

MODEL = "model"


def _own_model(node: Node, up_to: int):
    model, kept = node.new_model(), node.state.load_round(MODEL, node.run_id, up_to)
    if kept is not None:
        model.load_state_dict({k: torch.from_numpy(v) for k, v in kept[0].items()})
    return model, kept is not None


def _keep(node: Node, model) -> None:
    node.state.save_round(MODEL, {k: v.numpy() for k, v in model.state_dict().items()}, node.run_id, node.server_round)


def train(node: Node, request: Request) -> RecordDict:
    model, _ = _own_model(node, node.server_round - 1)
    loss = node.fit(model, node.cfg.settings.epochs)
    _keep(node, model)
    return protocol.content(metrics={"num-examples": len(node.data.x_train), "train-loss": loss})


def evaluate(node: Node, request: Request) -> RecordDict:
    model, trained = _own_model(node, node.server_round)
    if not trained:
        node.fit(model, request.settings.scratch_epochs)
        _keep(node, model)
    return node.test_reply(model)
'''


def _quoted(anchor: str) -> str:
    """`anchor`, after checking the page writes it: the test follows the page, not its own idea."""
    assert f"`{anchor}" in PAGE, f"docs/adding-a-strategy.md no longer quotes {anchor!r}, which this test follows"
    return anchor


def _edit_line(path: Path, holding: str, edit, start: str = "") -> None:
    """Apply `edit` to the one line of `path` (after the line starting with `start`) that holds
    `holding`; a file that drifted from the page fails, naming the file and the anchor."""
    lines = path.read_text().splitlines(keepends=True)
    first = next((i for i, line in enumerate(lines) if line.startswith(start)), len(lines))
    hits = [i for i in range(first, len(lines)) if holding in lines[i]]
    assert len(hits) == 1, f"{path.as_posix()}: {len(hits)} lines hold {holding!r}; the page says to add the toy there"
    lines[hits[0]] = edit(lines[hits[0]])
    path.write_text("".join(lines))


def _add_after(path: Path, holding: str, *new: str, start: str = "") -> None:
    """Add the lines `new` after the line holding `holding`, indented as it is."""

    def add(line: str) -> str:
        indent = line[: len(line) - len(line.lstrip())]
        return line + "".join(f"{indent}{n}\n" for n in new)

    _edit_line(path, holding, add, start)


def write_folder(root: Path) -> None:
    """Steps 1-3: `florist/strategies/toy/` with spec.py, server.py and client.py."""
    for name in ("spec", "server", "client"):
        _quoted(f"florist/strategies/local/{name}.py")
    folder = root / "florist" / "strategies" / "toy"
    folder.mkdir()
    for name, text in {"__init__": "", "spec": SPEC, "server": SERVER, "client": CLIENT}.items():
        (folder / f"{name}.py").write_text(text)


def add_config_keys(root: Path) -> None:
    """Step 1's last but one point: the section's keys in `[tool.flwr.app.config]`."""
    _add_after(root / "pyproject.toml", _quoted("[tool.flwr.app.config]"), "toy-epochs = 1")


def register_spec(root: Path) -> None:
    """Step 4, `florist/apps/registry.py`: the spec in `STRATEGIES`, beside Local's."""
    registry = root / _quoted("florist/apps/registry.py")
    _quoted("STRATEGIES")
    _add_after(
        registry, "from florist.strategies.local.spec import LOCAL", "from florist.strategies.toy.spec import TOY"
    )
    _edit_line(registry, "LOCAL", lambda line: re.sub(r"\bLOCAL\b", "LOCAL, TOY", line), start="STRATEGIES")


def add_handlers(root: Path) -> None:
    """Step 4, `florist/apps/client.py`: each message type with its function in `HANDLERS`."""
    client_app = root / _quoted("florist/apps/client.py")
    _quoted("HANDLERS")
    local = _quoted('"train.local": local.train')
    _add_after(client_app, "import client as local", "from florist.strategies.toy import client as toy")
    _add_after(client_app, local, '"train.toy": toy.train,', '"evaluate.toy": toy.evaluate,')


def add_server_half(root: Path) -> None:
    """Step 4, `florist/apps/server.py`: the strategy's name with its server half in `SERVER_HALVES`."""
    server_app = root / _quoted("florist/apps/server.py")
    _quoted("SERVER_HALVES")
    local = _quoted('"local": Local')
    _add_after(
        server_app, "from florist.strategies.local.server import Local", "from florist.strategies.toy.server import Toy"
    )
    _add_after(server_app, local, '"toy": Toy,')


STEPS = (write_folder, add_config_keys, register_spec, add_handlers, add_server_half)


def _checkout_with_toy(root: Path, skip=()) -> Path:
    """A copy of the package and pyproject.toml with the page's steps done (but `skip`)."""
    shutil.copytree(REPO / "florist", root / "florist", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root)
    for step in STEPS:
        if step not in skip:
            step(root)
    return root


def _python(root: Path, *args: str) -> subprocess.CompletedProcess:
    """`python *args` in the copy, on the copy's package rather than the checkout's."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _simulate(root: Path, *flags: str) -> subprocess.CompletedProcess:
    return _python(root, "-m", "florist", "simulate", "--runtime", "in-process", "--strategy", "toy", *flags)


def test_the_page_adds_a_strategy_that_trains(tmp_path):
    root = _checkout_with_toy(tmp_path / "checkout")
    results = tmp_path / "results"
    flags = ["--rounds", "2", "--num-clients", "3", "--results-dir", str(results), "--run-config", "toy-epochs=2"]
    run = _simulate(root, *flags)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((results / "results.json").read_text())
    assert report["strategy"] == "toy" and report["config"]["toy-epochs"] == 2
    assert [r["round"] for r in report["rounds"]] == [1, 2]
    assert {e["type"] for r in report["rounds"] for e in r["exchanges"]} == {"train.toy", "evaluate.toy"}
    accuracies = {c["client"]: c["accuracy"] for c in report["clients"]}
    assert len(accuracies) == 3 and min(accuracies.values()) > 0.3, accuracies  # chance is 0.1 on digits


@pytest.mark.parametrize("with_keys", [True, False])
def test_the_config_test_passes_once_the_keys_are_in_pyproject(tmp_path, with_keys):
    """The page: `tests/test_config.py` fails until the keys match; so it does, in the copy."""
    root = _checkout_with_toy(tmp_path / "checkout", skip=() if with_keys else (add_config_keys,))
    (root / "tests").mkdir()
    for name in ("conftest.py", _quoted("tests/test_config.py").removeprefix("tests/")):
        shutil.copy(REPO / "tests" / name, root / "tests")
    test = "tests/test_config.py::test_pyproject_run_config_lists_every_declared_setting_with_its_default"
    run = _python(root, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", test)
    assert (run.returncode == 0) == with_keys, run.stdout[-3000:]
    assert with_keys or "toy-epochs" in run.stdout, run.stdout[-3000:]


@pytest.mark.parametrize("step", [register_spec, add_handlers, add_server_half], ids=lambda s: s.__name__)
def test_a_missed_step_fails_in_one_line_naming_the_toy(tmp_path, step):
    run = _simulate(_checkout_with_toy(tmp_path / "checkout", skip=(step,)), "--rounds", "1", "--num-clients", "3")
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert len(errors) == 1 and "toy" in errors[0], run.stderr[-3000:]
