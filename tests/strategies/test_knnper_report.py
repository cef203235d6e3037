"""kNN-Per's section of report.md (issue 54): its plot is no row of the table above it, and a λ
the same for every client (the prior, under `shrunk`) is said in words, not drawn flat."""

from florist.server.report import markdown
from florist.strategies.knnper.server import report

CONFIG = {"knn-select": "shrunk", "knn-prior": "0.5,10,1", "knn-prior-weight": 5.0}


def _results(lambdas):
    clients = [{"seen": i % 2 == 0, "num_train": 10 * (i + 1), "lambda": lam} for i, lam in enumerate(lambdas)]
    return {"clients": clients, "config": CONFIG, "strategy": "knnper"}


def test_the_plot_follows_a_blank_line_and_a_heading(tmp_path):
    section = report(_results([0.2, 0.5, 1.0]), tmp_path)
    plot = section.index("![lambda vs local data size](lambda_vs_size.png)")
    assert section[0] == "" and section[plot - 1] == "" and (tmp_path / "lambda_vs_size.png").exists()
    table_then_section = ["| a | b |", "|---|---|", "| 1 | 2 |", *section]
    assert "| 1 | 2 |\n\n" in "\n".join(table_then_section)  # the table ends before the section starts


def test_every_client_at_the_prior_is_said_and_not_plotted(tmp_path):
    [said] = [line for line in report(_results([0.5, 0.5, 0.5]), tmp_path) if line.startswith("Every")]
    assert said.startswith("Every client has λ = 0.5, the prior (knn-prior 0.5,10,1): under knn-select shrunk")
    assert not (tmp_path / "lambda_vs_size.png").exists()


def test_the_whole_report_renders_the_section_apart_from_the_exchange_table(tmp_path):
    results = _results([0.2, 1.0]) | {
        "config": CONFIG | {"partition": "iid", "model": "cnn", "seed": 1, "unseen-fraction": 0.2},
        "summary": {
            g: {"num_clients": 0, "mean_accuracy": None, "bottom_decile_accuracy": None} for g in ("seen", "unseen")
        },
        "rounds": [],
    }
    text = markdown(results, report(results, tmp_path))
    before = text[: text.index("![lambda vs local data size]")].rstrip("\n").splitlines()
    assert before[-1] == "## λ per client" and not before[-1].startswith("|")
