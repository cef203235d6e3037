"""What `florist compare` says and draws beyond its table: which runs it keeps, resumes and
starts when started again after a cut, and every strategy's accuracy per round in one figure."""

import json
import re

import numpy as np
import pytest

from florist.cli import main
from florist.cli.compare import RunBars
from florist.runners.compare import round_series, rounds_figure

ARGS = ["--strategies", "fedavg,local", "--seeds", "1,2", "--num-clients", "3", "--rounds", "2"]


def _compare(out):
    return main(["compare", *ARGS, "--out", str(out), "--runtime", "in-process"])


def test_a_compare_started_again_after_a_cut_says_what_it_keeps_resumes_and_starts(tmp_path, capsys, monkeypatch):
    """The first start is cut (as by Ctrl-C) after round 1 of its third run, local/seed1; the
    second keeps fedavg's two, resumes local/seed1 from its checkpoint and starts local/seed2,
    says so before any run and counts them at the end."""
    rounds = []

    def cut_in_third_run(self, row):
        rounds.append(row["round"])
        if len(rounds) == 5:  # fedavg/seed1 and seed2 (2 rounds each), then round 1 of local/seed1
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(RunBars, "round", cut_in_third_run)
        assert _compare(tmp_path) == 130
    assert (tmp_path / "local" / "seed1" / "checkpoint.pt").is_file()
    assert not list((tmp_path / "local" / "seed2").iterdir())  # made before any run starts, empty
    first = capsys.readouterr().err
    assert "florist: starts 4 runs from round 1: fedavg/seed1, fedavg/seed2, local/seed1, local/seed2" in first

    assert _compare(tmp_path) == 0
    out, err = capsys.readouterr()
    plan = [
        line for line in err.splitlines() if line.startswith(("florist: keeps", "florist: resumes", "florist: starts"))
    ]
    ended = re.findall(r"^florist: (\w+ seed \d) (kept from before|done in [\d.]+ s): seen", err, re.M)
    assert [(run, how.split(" in ")[0]) for run, how in ended] == [
        ("fedavg seed 1", "kept from before"),
        ("fedavg seed 2", "kept from before"),
        ("local seed 1", "done"),  # resumed
        ("local seed 2", "done"),
    ], err
    assert plan == [
        "florist: keeps 2 runs finished with this config: fedavg/seed1, fedavg/seed2",
        "florist: resumes 1 run from its checkpoint: local/seed1 after round 1",
        "florist: starts 1 run from round 1: local/seed2",
    ]
    assert "4 runs: 2 kept, 1 resumed, 1 started" in out.splitlines()
    resumed = json.loads((tmp_path / "local" / "seed1" / "results.json").read_text())
    assert resumed["complete"] and [r["round"] for r in resumed["rounds"]] == [1, 2]

    assert _compare(tmp_path) == 0  # nothing left to do
    assert "4 runs: 4 kept, 0 resumed, 0 started" in capsys.readouterr().out.splitlines()  # the resumed one too


def test_compare_rounds_png_draws_each_strategys_accuracy_per_round_over_its_seeds(tmp_path):
    assert _compare(tmp_path) == 0
    assert (tmp_path / "compare_rounds.png").stat().st_size > 0
    assert "(compare_rounds.png)" in (tmp_path / "compare.md").read_text()
    figures = json.loads((tmp_path / "compare.json").read_text())
    for strategy in ("fedavg", "local"):
        runs = [json.loads((tmp_path / strategy / f"seed{s}" / "results.json").read_text()) for s in (1, 2)]
        per_round = np.array([[r["accuracy"] for r in run["rounds"]] for run in runs])  # seeds × rounds
        series = figures["per_round"][strategy]
        assert series["round"] == [1, 2] and series["seeds"] == [2, 2]
        assert series["mean"] == pytest.approx(per_round.mean(axis=0).tolist())
        assert series["min"] == per_round.min(axis=0).tolist() and series["max"] == per_round.max(axis=0).tolist()
    ax = rounds_figure(figures["per_round"], "s").axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["fedavg", "local"]
    assert [text.get_text() for text in ax.get_legend().get_texts()] == ["fedavg", "local"]
    assert np.allclose(ax.get_lines()[0].get_ydata(), 100 * np.array(figures["per_round"]["fedavg"]["mean"]))
    assert len(ax.collections) == 2  # a min–max band per strategy: two seeds each


def _run(strategy, accuracies):
    return {"strategy": strategy, "rounds": [{"round": i + 1, "accuracy": a} for i, a in enumerate(accuracies)]}


def test_the_series_skips_rounds_not_evaluated_and_draws_no_band_for_one_seed():
    series = round_series([_run("fedavg", [None, 0.5, float("nan"), 0.7]), _run("local", [0.2])])
    assert series["fedavg"] == {
        "round": [2, 4],
        "mean": [0.5, 0.7],
        "min": [0.5, 0.7],
        "max": [0.5, 0.7],
        "seeds": [1, 1],
    }
    ax = rounds_figure(series, "s").axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["fedavg", "local"] and not ax.collections
