"""report.md says why the unseen clients' global-model row (FedAvg's own, another strategy's
`(global model)` row) can read 2.5 % or 0 % (issue 54): the shared model, never trained by them,
on a skewed partition; and says nothing where it is not so."""

from florist.server.report import global_model_note, markdown

CONFIG = {"partition": "dirichlet:0.3", "num-classes": 10, "model": "cnn", "seed": 1, "unseen-fraction": 0.2}
EMPTY = {"num_clients": 0, "mean_accuracy": None, "bottom_decile_accuracy": None}


def _results(seen_global, unseen_global, strategy="knnper"):
    field = "accuracy" if strategy == "fedavg" else "global_accuracy"
    clients = [
        {"client": "a", "seen": True, field: seen_global, "num_test": 10},
        {"client": "b", "seen": False, field: unseen_global, "num_test": 6},
    ]
    summary = {"seen": EMPTY, "unseen": EMPTY}
    return {"strategy": strategy, "clients": clients, "config": CONFIG, "summary": summary, "rounds": []}


def test_an_unseen_global_row_below_chance_is_explained_in_the_report():
    report = markdown(_results(0.30, 0.025))
    [note] = [line for line in report.splitlines() if line.startswith("The unseen clients' `(global model)` row")]
    assert "(2.5%, chance 10.0%; 1 client, 6 test images)" in note and "`dirichlet:0.3`" in note
    assert "never trained" in note and "30.0% on the clients that did" in note and "personalized row" in note


def test_fedavgs_own_unseen_row_at_zero_is_explained_too():
    # a 4-class folder, 6 clients of dirichlet:0.3: FedAvg's one held-out client scored 0 of 6
    report = markdown(_results(0.412, 0.0, strategy="fedavg"))
    [note] = [line for line in report.splitlines() if line.startswith("The unseen row")]
    assert "(0.0%, chance 10.0%; 1 client, 6 test images)" in note and "personalized row" not in note
    knnper = _results(0.412, 0.0, strategy="fedavg") | {"strategy": "knnper"}
    assert global_model_note(knnper) == []  # kNN-Per's own row is not the global model


def test_no_note_where_the_unseen_global_row_is_like_the_seen_one():
    assert global_model_note(_results(0.90, 0.85)) == []
    assert global_model_note(_results(0.90, 0.85, strategy="fedavg")) == []
    assert (
        global_model_note({"strategy": "knnper", "clients": [{"seen": True, "accuracy": 0.9}], "config": CONFIG}) == []
    )  # no global row
