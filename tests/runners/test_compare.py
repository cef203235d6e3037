"""`florist compare`: every strategy × seed, the table from the runs' own results, runs kept
or resumed when started again."""

import json

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
    table = json.loads((tmp_path / "compare.json").read_text())
    assert (tmp_path / "compare.png").stat().st_size > 0 and "| fedavg | 2 |" in (tmp_path / "compare.md").read_text()
    for strategy in ("fedavg", "local"):
        runs = [json.loads((tmp_path / strategy / f"seed{s}" / "results.json").read_text()) for s in (1, 2)]
        assert [r["config"]["shift"] for r in runs] == ["relabel:2"] * 2
        seen = [r["summary"]["seen"]["mean_accuracy"] for r in runs]
        assert table["rows"][strategy]["seen_mean_accuracy"] == [np.mean(seen), np.std(seen)]
    kept = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/seed*/results.json")}
    capsys.readouterr()
    assert _compare(tmp_path) == 0  # started again: every run is finished with this config, none runs
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    assert _compare(tmp_path, "--unseen-fraction", "0.5") == 0  # another config: every run again
    assert all(p.stat().st_mtime_ns != t for p, t in kept.items())


def test_compare_refuses_an_unknown_strategy_by_name(tmp_path, capsys):
    assert main(["compare", "--strategies", "fedavg,fedprox", "--out", str(tmp_path)]) == 2
    assert "--strategies: unknown strategy 'fedprox'" in capsys.readouterr().err
