"""report.md says why the unseen clients' `(global model)` row can read 2.5 % (issue 54): the
shared model, never trained by them, on a skewed partition; and says nothing where it is not so."""

from florist.server.report import global_model_note, markdown

CONFIG = {"partition": "dirichlet:0.3", "num-classes": 10, "model": "cnn", "seed": 1, "unseen-fraction": 0.2}
EMPTY = {"num_clients": 0, "mean_accuracy": None, "bottom_decile_accuracy": None}


def _results(seen_global, unseen_global):
    clients = [
        {"client": "a", "seen": True, "global_accuracy": seen_global, "num_test": 10},
        {"client": "b", "seen": False, "global_accuracy": unseen_global, "num_test": 10},
    ]
    summary = {"seen": EMPTY, "unseen": EMPTY}
    return {"strategy": "knnper", "clients": clients, "config": CONFIG, "summary": summary, "rounds": []}


def test_an_unseen_global_row_below_chance_is_explained_in_the_report():
    report = markdown(_results(0.30, 0.025))
    [note] = [line for line in report.splitlines() if line.startswith("The unseen clients' `(global model)` row")]
    assert "(2.5%, chance 10.0%)" in note and "`dirichlet:0.3`" in note and "never trained it" in note


def test_no_note_where_the_unseen_global_row_is_like_the_seen_one():
    assert global_model_note(_results(0.90, 0.85)) == []
    assert global_model_note({"clients": [{"seen": True, "accuracy": 0.9}], "config": CONFIG}) == []  # no global row
