"""Paper presets: every shipped file parses at both scales into valid run configs; the full ones
build their models, server halves and partitioners (their hub datasets are not reachable from
the test machines, so their data is not loaded); every small one runs end to end through
`florist compare`, and compare.md prints the paper's figures beside florist's."""

import dataclasses
import json

import datasets
import numpy as np
import pytest
import torch

from florist.apps.registry import STRATEGIES
from florist.apps.server import server_half
from florist.cli import main
from florist.common import data, models
from florist.config import RunConfig
from florist.runners import compare, presets

NAMES = presets.names()
# Clients trained per round in each paper's setting.
PER_ROUND = {
    "knnper-cifar10": 200,  # every client, every round
    "pefll-cifar10": 5,  # 5 of the 90 that train
    "odpfl-cifar10": 9,  # 0.1 of the 90 training clients
    "perfedckt-cifar10": 10,  # 10 % of 100
    "fedattn-emnist": 10,  # 10 writers
}


def _configs(preset: presets.Preset) -> list[RunConfig]:
    return [RunConfig.from_mapping(preset.run_config | {"strategy": s}) for s in preset.strategies]


def test_florist_ships_a_preset_for_each_paper():
    assert NAMES == ["fedattn-emnist", "knnper-cifar10", "odpfl-cifar10", "pefll-cifar10", "perfedckt-cifar10"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("scale", presets.SCALES)
def test_every_preset_parses_into_valid_run_configs_and_names_the_papers_figures(name, scale):
    preset = presets.load(name, scale)
    assert set(preset.strategies) <= set(STRATEGIES) and preset.seeds and preset.num_clients >= 2
    configs = _configs(preset)
    assert set(preset.paper_values) <= set(preset.strategies)
    assert preset.paper_values  # every preset carries its paper's figures
    assert preset.paper and preset.reproduces
    if scale == "small":  # embedded data: nothing to download
        assert {c.dataset for c in configs} <= {"digits", "mnist5k"}


@pytest.mark.parametrize("name", NAMES)
def test_every_full_preset_builds_its_models_server_halves_and_partitioner(name, tmp_path):
    """Each full preset builds its models, server halves and partitioner, and trains as many
    clients per round as its paper does."""
    preset = presets.load(name, "full")
    shape = preset.input_shape
    if "public-dir" in preset.run_config:  # a folder the user makes (the paper's P): here, random images
        np.savez(tmp_path / "public.npz", x=np.random.default_rng(0).integers(0, 256, (64, *shape), dtype=np.uint8))
        preset = dataclasses.replace(preset, run_config=preset.run_config | {"public-dir": str(tmp_path)})
    for cfg in _configs(preset):
        assert cfg.dataset not in ("digits", "mnist5k")  # the paper's own data, by hub id
        for model in {cfg.model, *filter(None, getattr(cfg.settings, "client_models", "").split(","))}:
            net = models.build_model(model, shape, cfg.num_classes)
            assert net(torch.zeros(2, *shape)).shape == (2, cfg.num_classes)
        num_seen = preset.num_clients - round(cfg.unseen_fraction * preset.num_clients)
        server = server_half(cfg.strategy)(cfg, None, shape, num_seen)
        assert server.sample_size(num_seen) == PER_ROUND[name], cfg.strategy  # the paper's participation
        kind, column = data.parse_partition(cfg.partition)
        if kind == "natural":
            assert column  # one client per value of this column of the dataset
        else:  # over labels counted as in the paper's dataset (CIFAR-10's train split: 5,000 per class)
            partitioner = data.make_partitioner(cfg.partition, preset.num_clients, cfg.seed, cfg.min_partition_size)
            partitioner.dataset = datasets.Dataset.from_dict({"label": np.repeat(np.arange(cfg.num_classes), 5000)})
            sizes = [len(partitioner.load_partition(i)) for i in range(preset.num_clients)]
            assert sum(sizes) == 5000 * cfg.num_classes and min(sizes) >= max(cfg.min_partition_size, 3)


@pytest.mark.parametrize("name", NAMES)
def test_every_small_preset_runs_and_prints_the_papers_figures_beside_florists(name, tmp_path, capsys):
    """Each small preset as a user runs it, cut to one seed and two rounds to stay in CI's time."""
    out = tmp_path / "out"
    args = ["compare", "--preset", name, "--scale", "small", "--seeds", "1", "--rounds", "2", "--out", str(out)]
    assert main([*args, "--runtime", "in-process"]) == 0
    preset = presets.load(name, "small")
    figures = json.loads((out / "compare.json").read_text())
    assert set(figures["rows"]) == set(preset.strategies)
    assert figures["paper"]["values"] == preset.paper_values
    text = (out / "compare.md").read_text()
    assert f"## The paper's figures: {preset.source()}" in text
    papers_table = text.split("## The paper's figures")[1]
    for strategy, groups in preset.paper_values.items():
        row = next(line for line in papers_table.splitlines() if line.startswith(f"| {strategy} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert [cells[1], cells[3]] == [f"{groups[g]:.1f}" if g in groups else "–" for g in ("seen", "unseen")]
    runs = [json.loads((out / s / "seed1" / "results.json").read_text())["config"] for s in preset.strategies]
    assert {run["num-server-rounds"] for run in runs} == {2}  # the flag beside the preset won
    applied = {k: run[k] for run in runs for k in preset.run_config if k in run and k != "num-server-rounds"}
    assert applied == {k: v for k, v in preset.run_config.items() if k != "num-server-rounds"}


def test_the_papers_table_puts_each_figure_in_its_strategys_row():
    rows = {"fedavg": {"seen_mean_accuracy": [0.5, 0.01], "unseen_mean_accuracy": [None, None]}}
    paper = compare.Paper(
        "A paper: Table 1", "full", {"fedavg": {"seen": 15.5}, "pefll": {"seen": 88.9, "unseen": 88.1}}
    )
    lines = compare.paper_lines(rows, paper)
    assert "| fedavg | 15.5 | 50.0 ± 1.0 | – | – |" in lines
    assert "| pefll | 88.9 | not run | 88.1 | not run |" in lines


def test_a_preset_file_with_a_mistake_is_refused_in_one_line_naming_file_and_key(tmp_path, capsys):
    good = presets.path_of("pefll-cifar10").read_text()
    broken = tmp_path / "mine.toml"
    broken.write_text(good.replace("num-clients", "num_clients", 1))
    assert main(["compare", "--preset", str(broken), "--scale", "full", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(broken) in err and "'num_clients'" in err
    assert main(["compare", "--preset", "pefll-cifar100", "--out", str(tmp_path / "o")]) == 2
    assert "no preset 'pefll-cifar100'" in capsys.readouterr().err
