"""A run whose server dies resumes from its checkpoint and ends exactly where the uninterrupted
run ends, for every strategy: same per-client accuracies, same round rows."""

import dataclasses
from pathlib import Path

import pytest
import torch

from florist.apps.client import app as client_app
from florist.apps.registry import STRATEGIES
from florist.apps.server import run
from florist.cli import main
from florist.config import RunConfig
from florist.runners.inprocess import InProcessGrid, run_in_process, server_identity
from florist.server.checkpoint import Checkpoint, resumed_config

NUM_CLIENTS = 4


class ServerCrash(Exception):
    """The ServerApp process dying."""


class CrashingGrid(InProcessGrid):
    """Dies in round `at` right after its first exchange: the nodes have done their part of
    round `at` (a node keeps state from a later round than the checkpoint), the server has not
    checkpointed it."""

    def __init__(self, at: int, *args):
        super().__init__(*args)
        self.at, self.types = at, set()

    def push_messages(self, messages):
        messages = list(messages)
        self.types |= {m.metadata.message_type for m in messages if m.metadata.group_id == str(self.at)}
        if len(self.types) > 1:
            raise ServerCrash
        return super().push_messages(messages)


def _nodes():
    return [{"partition-id": i, "num-partitions": NUM_CLIENTS} for i in range(NUM_CLIENTS)]


def _cfg(tmp_path, strategy: str, name: str) -> RunConfig:
    return RunConfig.from_mapping(
        {
            "strategy": strategy,
            "num-server-rounds": 4,
            "min-nodes": NUM_CLIENTS,
            "fraction-train": 0.75,
            "min-train-nodes": 2,
            "partition": "dirichlet:0.5",
            "seed": 3,
            "results-dir": str(tmp_path / name),
            "fedattn-warmup": 1,
            "eval-every": 2,
            "model": "mlp",
            "ckt-steps": 5,
            "public-size": 100,
            "hn-local-steps": 10,
        }
    )  # (small models and few steps: exactness does not need long training)


def _accuracies(results):
    return {c["client"]: c["accuracy"] for c in results["clients"]}


def _rows(results):
    """The round rows without timings, and without byte counts (each message carries the run
    id, and a random id's protobuf varint may be a byte shorter or longer)."""
    ignored = ("seconds", "exchanges", "bytes_up", "bytes_down")  # and each exchange's own `<type>_bytes_*`
    return [{k: v for k, v in row.items() if not k.endswith(ignored)} for row in results["rounds"]]


def _crash(cfg: RunConfig, at: int) -> None:
    grid = CrashingGrid(at, client_app, _nodes())
    with server_identity(grid.run_id), pytest.raises(ServerCrash):
        run(grid, cfg, None, grid.run_id)
    assert Checkpoint.load(cfg.results_dir).round == at - 1


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_run_resumed_after_a_server_crash_ends_exactly_like_the_uninterrupted_run(tmp_path, strategy):
    whole = run_in_process(_cfg(tmp_path, strategy, "whole"), NUM_CLIENTS)
    cfg = _cfg(tmp_path, strategy, "resumed")
    _crash(cfg, 2)
    # A new server process: new run id, no memory; the nodes keep their state folders.
    resumed = run_in_process(resumed_config(cfg.results_dir, {}), NUM_CLIENTS)
    assert resumed["complete"] and [r["round"] for r in resumed["rounds"]] == [1, 2, 3, 4]
    assert _accuracies(resumed) == _accuracies(whole)
    assert _rows(resumed) == _rows(whole)


def test_florist_simulate_resume_refuses_a_differing_flag_by_name(tmp_path, capsys):
    """The CLI path takes the run's own config from its folder; a flag given beside it must
    agree. (Resuming in Ray's workers after a real Ctrl-C: tests/deploy/test_interrupt.py.)"""
    cfg = _cfg(tmp_path, "local", "resumed")
    _crash(cfg, 2)
    folder = cfg.results_dir
    assert main(["simulate", "--resume", folder, "--strategy", "fedavg", "--rounds", "4"]) == 2
    assert "the run config differs in strategy = 'local' there, 'fedavg' here" in capsys.readouterr().err
    assert main(["simulate", "--resume", folder, "--num-clients", "6"]) == 2
    assert f"its run had {NUM_CLIENTS} nodes, not 6" in capsys.readouterr().err
    assert Checkpoint.load(folder).round == 1  # refused before anything ran


def test_a_pefll_run_checkpointed_before_class_means_existed_goes_on_without_them(tmp_path):
    """`hn-class-means` came on by default after PeFLL runs that read none: a checkpoint of
    such a run (its config without the key, its state without class means) resumes as the
    run it was, and ends exactly like it."""
    old = {"strategy": "pefll", "hn-class-means": False}
    whole = run_in_process(_cfg(tmp_path, "pefll", "whole").replace(**old), NUM_CLIENTS)
    cfg = _cfg(tmp_path, "pefll", "resumed").replace(**old)
    _crash(cfg, 2)
    path = Path(cfg.results_dir) / "checkpoint.pt"
    saved = torch.load(path, weights_only=True)
    del saved["config"]["hn-class-means"], saved["state"]["class_means"]
    torch.save(saved, path)
    resumed = run_in_process(resumed_config(cfg.results_dir, {}), NUM_CLIENTS)
    assert resumed["config"]["hn-class-means"] is False
    assert _accuracies(resumed) == _accuracies(whole)
    assert _rows(resumed) == _rows(whole)


@pytest.mark.parametrize("damage", ["missing", "garbled"])
def test_a_checkpoint_missing_or_garbling_a_field_is_one_line_naming_it(tmp_path, damage):
    from florist.server.checkpoint import FILE, VERSION, Checkpoint

    fields = {f.name: None for f in dataclasses.fields(Checkpoint)}
    saved = {"version": VERSION, "round": 1, "config": {}, "run_id": 1, "nodes": [], "state": {}, "failures": []}
    # every field but one, well formed (bindings may be absent: checkpoints before bind-node-keys)
    assert set(saved) - {"version"} == set(fields) - {"rounds", "bindings"}
    if damage == "garbled":
        saved |= {"rounds": "not a list"}
    torch.save(saved, tmp_path / FILE)
    with pytest.raises(ValueError, match=r"the checkpoint lacks or garbles rounds$"):
        Checkpoint.load(tmp_path)
