"""`florist compare`: every strategy × seed, the table from the runs' own results, runs kept
or resumed when started again."""

import json
import re

import numpy as np

from florist.cli import main


def _compare(out, *extra):
    return main(
        [
            "compare",
            "--strategies",
            "fedavg,local",
            "--seeds",
            "1,2",
            "--num-clients",
            "4",
            "--rounds",
            "1",
            "--shift",
            "relabel:2",
            "--out",
            str(out),
            "--runtime",
            "in-process",
            "--run-config",
            "eval-every=0",
            *extra,
        ]
    )


def test_compare_writes_the_table_of_every_strategy_and_seed_and_keeps_finished_runs(tmp_path, capsys):
    assert _compare(tmp_path) == 0
    out, err = capsys.readouterr()  # not a terminal: no bars, yet a line per run as it ends (issue 54)
    done = re.findall(r"^florist: (\w+) seed (\d) done in [\d.]+ s: seen [\d.]+ %", err, re.M)
    assert done == [("fedavg", "1"), ("fedavg", "2"), ("local", "1"), ("local", "2")], err
    assert "━" not in err  # nor the bars' last frame, which rich printed at the end
    header, *rows = out.splitlines()[:3]
    assert header.split()[:3] == ["strategy", "runs", "seen"] and [r.split()[:2] for r in rows] == [
        ["fedavg", "2"],
        ["local", "2"],
    ]
    assert "|" not in out and "![" not in out, out  # plain text, not compare.md's markdown
    table = json.loads((tmp_path / "compare.json").read_text())
    assert (tmp_path / "compare.png").stat().st_size > 0 and "| fedavg | 2 |" in (tmp_path / "compare.md").read_text()
    for strategy in ("fedavg", "local"):
        runs = [json.loads((tmp_path / strategy / f"seed{s}" / "results.json").read_text()) for s in (1, 2)]
        assert [r["config"]["shift"] for r in runs] == ["relabel:2"] * 2
        seen = [r["summary"]["seen"]["mean_accuracy"] for r in runs]
        assert table["rows"][strategy]["seen_mean_accuracy"] == [np.mean(seen), np.std(seen)]
    kept = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/seed*/results.json")}
    assert _compare(tmp_path) == 0  # started again: every run is finished with this config, none runs
    assert capsys.readouterr().err.count("kept from before: seen") == 4
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    assert _compare(tmp_path, "--unseen-fraction", "0.5") == 0  # another config: every run again
    assert all(p.stat().st_mtime_ns != t for p, t in kept.items())


def test_compare_refuses_an_unknown_strategy_by_name(tmp_path, capsys):
    assert main(["compare", "--strategies", "fedavg,fedprox", "--out", str(tmp_path)]) == 2
    assert "--strategies: unknown strategy 'fedprox'" in capsys.readouterr().err


def _run(strategy, seed, seen_clients, accuracy):
    group = {"num_clients": seen_clients, "mean_accuracy": accuracy, "bottom_decile_accuracy": accuracy}
    empty = {"num_clients": 0, "mean_accuracy": None, "bottom_decile_accuracy": None}
    rounds = [{"bytes_up": 1000, "bytes_down": 2000, "seconds": 1.0}]
    return {
        "strategy": strategy,
        "config": {"seed": seed},
        "summary": {"seen": group, "unseen": empty},
        "rounds": rounds,
    }


def test_the_table_counts_the_runs_that_scored_clients_and_shows_no_spread_for_one():
    """A run that scored no client is not averaged in and is counted apart; a figure from a
    single run is shown without ± (never "± 0.0")."""
    from florist.runners.compare import markdown, table

    rows = table(
        [_run("fedavg", 1, 5, 0.794), _run("fedavg", 2, 0, None), _run("local", 1, 5, 0.5), _run("local", 2, 5, 0.7)]
    )
    assert rows["fedavg"]["scored"] == 1 and rows["fedavg"]["seen_mean_accuracy"] == [0.794, None]
    text = markdown(rows, "s")
    assert "| fedavg | 1 of 2 | 79.4 | 79.4 | – | – |" in text
    assert "| local | 2 | 60.0 ± 10.0 |" in text and "± 0.0" not in text
