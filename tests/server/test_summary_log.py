"""The ServerApp's log ends with the seen/unseen table `florist` commands print, as plain aligned
text, then the results folder: what `flwr run --stream` and the SuperLink log show at the end of a
run (an in-process run, its `flwr` log captured)."""

import logging
import re

from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.server.report import SUMMARY_COLUMNS


def test_the_servers_log_ends_with_the_summary_table_then_the_results_folder(tmp_path, caplog):
    values = {"strategy": "fedavg-ft", "num-server-rounds": 1, "partition": "iid", "unseen-fraction": 0.25}
    cfg = RunConfig.from_mapping(values | {"min-nodes": 4, "results-dir": str(tmp_path / "out")})
    with caplog.at_level(logging.INFO, logger="flwr"):
        results = run_in_process(cfg, 4)
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("flwr")]
    assert all(m.strip() for m in logged)  # no empty `INFO :` line of florist's
    assert logged[-1] == f"results in {(tmp_path / 'out').resolve()}"
    start = logged.index("florist · fedavg-ft · iid")
    header, rule, *rows = logged[start + 1 : -1]
    assert re.split(r"  +", header) == list(SUMMARY_COLUMNS)
    widths = [len(dashes) for dashes in rule.split("  ")]
    assert set(rule) == {"-", " "} and len(widths) == len(SUMMARY_COLUMNS)
    assert all("[" not in row and len(row) == len(header) for row in rows)  # figures right-aligned, no markup
    edges = [sum(widths[:i]) + 2 * i for i in range(len(widths) + 1)]
    cells = [[row[a:b].strip() for a, b in zip(edges, edges[1:])] for row in rows]
    expected = []
    for group in ("seen", "unseen"):
        s, clients = results["summary"][group], [c for c in results["clients"] if c["seen"] == (group == "seen")]
        expected.append(
            ["fedavg-ft", group, str(s["num_clients"])]
            + [f"{100 * s[k]:.1f}" for k in ("mean_accuracy", "bottom_decile_accuracy")]
        )
        expected.append(["(global model)", group, str(len(clients))])
    assert [c[:5] if c[0] == "fedavg-ft" else c[:3] for c in cells] == expected
