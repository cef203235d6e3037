"""The robust rules never silently degrade (florist/server/aggregation.py), on hand-made tensors:
a rule the replies left cannot support gives way to the median (or keeps the model), says so in
one warning and in `Outcome.note`; a reply equal to the model sent is left out, copies count
once, and weights are capped at the median so that one claim cannot stall Multi-Krum."""

from __future__ import annotations

import logging

import torch

from florist.server.aggregation import Aggregator

REFERENCE = {"w": torch.tensor([0.0, 0.0]), "n": torch.tensor(0)}


def states_of(*rows) -> list[dict[str, torch.Tensor]]:
    """One state per row: a float tensor `w` and an integer counter `n` (its index)."""
    return [{"w": torch.tensor(row, dtype=torch.float32), "n": torch.tensor(i)} for i, row in enumerate(rows)]


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_trimmed_mean_that_would_cut_nothing_is_the_median_and_says_so(caplog):
    """Five nodes, one refused: ⌊0.2·4⌋ = 0 would leave the ×1000 reply in a plain mean."""
    caplog.set_level(logging.WARNING, logger="flwr")
    out = Aggregator("trimmed:0.2")(
        states_of([1.0], [2.0], [4.0], [1000.0]), [1] * 4, REFERENCE | {"w": torch.zeros(1)}
    )
    assert out.rule == "median" and torch.equal(out.state["w"], torch.tensor([3.0]))
    assert out.note == "cuts nothing from 4 distinct replies: the median this round"
    assert warnings(caplog) == [f"aggregation trimmed:0.2: {out.note}"]
    five = Aggregator("trimmed:0.2")(states_of([1.0], [2.0], [4.0], [1000.0], [3.0]), [1] * 5)
    assert five.rule == "trimmed" and five.note == "" and torch.equal(five.state["w"], torch.tensor([3.0]))


def test_too_few_distinct_replies_leave_the_model_as_it_was():
    """Two replies: one of them can be anything, so no rule outvotes it."""
    for spec in ("median", "trimmed:0.2", "krum:1", "multikrum:1"):
        out = Aggregator(spec)(states_of([1.0, 1.0], [1e6, -1e6]), [1, 1], REFERENCE)
        assert out.rule == "unchanged" and out.kept == [], spec
        assert torch.equal(out.state["w"], REFERENCE["w"]) and "cannot outvote one node" in out.note, spec
    gradients = Aggregator("median")(states_of([1.0], [5.0]), [1, 1])  # no reference: the zero update
    assert torch.equal(gradients.state["w"], torch.tensor([0.0]))


def test_multikrums_kept_replies_weigh_at_most_the_median_claim():
    """The stall: a node next to θ_g (not equal: the no-op rule is not what stops it here)
    claims 10¹² examples. Multi-Krum keeps it, as it is central; uncapped, the round's model is
    that node's and the federation stands still."""
    honest = ([1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.5])
    out = Aggregator("multikrum:1")(states_of(*honest, [1e-6, 0.0]), [208, 207, 208, 208, 10**12], REFERENCE)
    assert 4 in out.kept and out.rule == "multikrum"
    kept = [([*honest, [1e-6, 0.0]])[i] for i in out.kept]
    expected = torch.tensor(kept, dtype=torch.float64).mean(0)  # every kept weight within 1 of 208
    torch.testing.assert_close(out.state["w"].double(), expected, rtol=0.01, atol=0)
    assert out.state["w"].norm() > 0.5


def test_a_reply_equal_to_the_model_sent_is_left_out():
    """θ_g lies amid the honest updates, so Krum picks a node that did not train at all."""
    honest = ([1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0], [0.9, 0.9])
    out = Aggregator("krum:1")(states_of(*honest, [0.0, 0.0]), [1] * 6, REFERENCE)
    assert 5 not in out.kept and out.rule == "krum" and len(out.kept) == 1
    assert out.note == "1 reply equal to the model sent (no training) left out"
    two = Aggregator("median")(states_of(*honest, [0.0, 0.0], [0.0, 0.0]), [1] * 7, REFERENCE)
    assert two.kept == [0, 1, 2, 3, 4] and torch.equal(two.state["w"], torch.tensor([0.0, 0.0]))
    assert two.note == "2 replies equal to the model sent (no training) left out"


def test_identical_replies_count_once_and_are_kept_together():
    """Two copies of one model are one vote: Krum scores a copy 0 against its twin, so two
    colluders sending one model beat krum:1, which tolerates one."""
    rows = ([1.0, 4.0], [1.0, 3.0], [-1.0, -2.0], [-3.0, 3.0], [3.0, -2.0], [3.0, -2.0])
    out = Aggregator("krum:1")(states_of(*rows), [1] * 6, REFERENCE)
    assert out.kept == [1] and torch.equal(out.state["w"], torch.tensor([1.0, 3.0]))
    assert out.note == "1 copy of another reply counted with it"
    median = Aggregator("median")(states_of([0.0], [1.0], [2.0], [10.0], [10.0]), [1] * 5)
    assert torch.equal(median.state["w"], torch.tensor([1.5]))  # the median of 0, 1, 2, 10
    assert median.kept == [0, 1, 2, 3, 4]  # the copy is in the model: not left out


def test_mean_counts_every_reply_as_before():
    out = Aggregator()(states_of([0.0], [0.0], [3.0]), [1, 1, 1], {"w": torch.zeros(1), "n": torch.tensor(0)})
    assert torch.equal(out.state["w"], torch.tensor([1.0])) and out.note == "" and out.kept == [0, 1, 2]
