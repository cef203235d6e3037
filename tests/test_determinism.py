"""Same seed, same results, for every strategy, whatever order the replies arrive in. Ray and
the SuperLink hand replies back in the order nodes finish, and float sums are not associative,
so a server that aggregates in arrival order drifts between runs of the same seed; the
in-process grid is made to answer in node order once and in reverse node order once."""

import pytest

from florist.apps.registry import STRATEGIES
from florist.config import RunConfig
from florist.runners import inprocess
from florist.runners.inprocess import run_in_process

# Two rounds on four clients, one held out; each strategy's costly knobs turned down.
CHEAP = {
    "num-server-rounds": 2,
    "partition": "dirichlet:0.5",
    "seed": 13,
    "unseen-fraction": 0.25,
    "min-nodes": 4,
    "eval-every": 0,
    "hn-local-steps": 5,
    "ckt-steps": 5,
    "ckt-public-batch": 32,
    "fedattn-warmup": 1,
    "finetune-epochs": 1,
}


class ReplyOrderGrid(inprocess.InProcessGrid):
    """An in-process grid whose replies come back sorted by node, or in reverse with `reverse`."""

    reverse = False

    def pull_messages(self, message_ids):
        return sorted(super().pull_messages(message_ids), key=lambda m: m.metadata.src_node_id, reverse=self.reverse)


def _run(tmp_path, monkeypatch, strategy: str, reverse: bool) -> dict:
    monkeypatch.setattr(inprocess, "InProcessGrid", ReplyOrderGrid)
    monkeypatch.setattr(ReplyOrderGrid, "reverse", reverse)
    cfg = RunConfig.from_mapping(CHEAP | {"strategy": strategy, "results-dir": str(tmp_path / f"reverse-{reverse}")})
    return run_in_process(cfg, 4)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_same_seed_gives_the_same_results_whatever_the_reply_order(tmp_path, monkeypatch, strategy):
    first, second = (_run(tmp_path, monkeypatch, strategy, reverse) for reverse in (False, True))
    assert not first["failures"] and not second["failures"]
    accuracies = lambda r: [(c["client"], c["seen"], c["accuracy"]) for c in r["clients"]]  # noqa: E731
    assert accuracies(first) == accuracies(second)
    assert any(c["accuracy"] is not None for c in first["clients"])  # there was something to compare
    # The training losses are more sensitive to a last-bit difference than accuracies are.
    assert [r["train_loss"] for r in first["rounds"]] == [r["train_loss"] for r in second["rounds"]]
