"""Secure aggregation's math: the server's unmasked result is the weighted mean within the
quantization bound, what it receives says nothing about any node's update, a node that drops after
sharing its keys does not stop the round while t remain (and below t the round stops in one line),
clipped values are counted, and a node refuses what would unmask it."""

import base64
import os

import numpy as np
import pytest
from flwr.app import ConfigRecord

from florist.common import secagg, secagg_server, shamir
from florist.common.secagg import HEADER, BelowThreshold, NodeState, SecAggSetup


def round_inputs(num_nodes: int, size: int, clip: float, seed: int = 0):
    """Random updates inside [-clip, clip] (so that none is clipped) and weights in [1, 500]."""
    rng = np.random.default_rng(seed)
    updates = {nid: rng.uniform(-0.9 * clip, 0.9 * clip, size) for nid in range(1, num_nodes + 1)}
    return updates, {nid: float(rng.uniform(1, 500)) for nid in updates}


def weighted_mean(updates, weights, nodes):
    return sum(weights[n] * updates[n] for n in nodes) / sum(weights[n] for n in nodes)


def bound(setup: SecAggSetup, weights, nodes) -> float:
    """How far the result may be from the exact weighted mean, from the range and the bits alone.

    A node sends q(r·x) for r = w/W rounded to a step 1/T (T = 2^bits): stochastic rounding is off
    by less than one step 2c/T per value, and the rounded weight by at most 1/(2T), which moves the
    mean by at most |r' − r|·|x − mean| ≤ 2c/(2T) per node. Summed over n nodes and divided by the
    rounded weight sum Σr' ≥ Σr − n/(2T): 3·n·c / (T·Σr')."""
    levels, n = 2**setup.bits, len(nodes)
    ratio_sum = sum(weights[i] for i in nodes) / setup.max_weight - n / (2 * levels)
    return 3 * n * setup.clip / (levels * ratio_sum)


@pytest.mark.parametrize(("clip", "bits"), [(8.0, 22), (1.0, 12)])
def test_the_unmasked_aggregate_is_the_weighted_mean_within_the_quantization_bound(clip, bits):
    updates, weights = round_inputs(4, 1000, clip)
    setup = SecAggSetup.for_nodes(4, clip=clip, bits=bits)
    result = secagg_server.simulate(updates, weights, setup)
    exact, most = weighted_mean(updates, weights, updates), bound(setup, weights, updates)
    assert np.abs(result.mean - exact).max() <= most
    # the bound tells the weighted mean from the plain one: a result that ignored the weights fails
    assert np.abs(np.mean(list(updates.values()), axis=0) - exact).max() > 10 * most
    assert result.weight_sum == pytest.approx(sum(weights.values()), abs=4 * setup.max_weight / 2**bits)
    assert (result.survivors, result.dropped, result.clipped) == ((1, 2, 3, 4), (), 0)


def test_no_masked_vector_the_server_receives_equals_or_correlates_with_its_nodes_update():
    updates, weights = round_inputs(4, 10_000, 8.0, seed=1)
    setup = SecAggSetup.for_nodes(4)
    received = {}

    def spy(stage, sender, recipient, payload):
        if recipient == 0 and isinstance(payload, np.ndarray):
            received[sender] = payload

    result = secagg_server.simulate(updates, weights, setup, spy=spy)
    assert sorted(received) == [1, 2, 3, 4]
    for nid, vector in received.items():
        update = updates[nid]
        assert not np.array_equal(vector[HEADER:], update)
        assert not np.array_equal(vector[HEADER:], np.round((update + 8.0) / 16.0 * 2**22))  # nor its quantized form
        assert abs(np.corrcoef(vector[HEADER:].astype(np.float64), update)[0, 1]) < 0.05
        assert vector[0] != round(weights[nid] / setup.max_weight * 2**22)  # the weight is masked too
    assert np.abs(result.mean - weighted_mean(updates, weights, updates)).max() <= bound(setup, weights, updates)


@pytest.mark.parametrize(
    ("stage", "included"),
    [
        ("share keys", [1, 3, 4, 5]),  # left before sharing keys: not part of the round
        ("collect masked vectors", [1, 3, 4, 5]),  # shared keys, sent no vector: its masks are removed
        ("unmask", [1, 2, 3, 4, 5]),  # sent its vector, then left: its seed is rebuilt from the others
    ],
)
def test_a_node_that_leaves_does_not_stop_the_round_while_the_threshold_remains(stage, included):
    updates, weights = round_inputs(5, 500, 8.0, seed=2)
    setup = SecAggSetup.for_nodes(5)
    assert setup.threshold == 3
    result = secagg_server.simulate(updates, weights, setup, leave={stage: {2}})
    assert list(result.survivors) == included
    assert result.dropped == ((2,) if stage == "collect masked vectors" else ())
    exact = weighted_mean(updates, weights, included)
    assert np.abs(result.mean - exact).max() <= bound(setup, weights, included)


@pytest.mark.parametrize(
    ("leave", "stage", "remaining"),
    [
        ({"collect masked vectors": {1, 2, 3}}, "collect masked vectors", 2),
        ({"collect masked vectors": {1}, "unmask": {2, 3}}, "unmask", 2),
    ],
)
def test_below_the_threshold_the_round_stops_naming_how_many_remain_and_the_threshold(leave, stage, remaining):
    updates, weights = round_inputs(5, 100, 8.0)
    with pytest.raises(BelowThreshold) as stopped:
        secagg_server.simulate(updates, weights, SecAggSetup.for_nodes(5), leave=leave)
    assert str(stopped.value) == (
        f"secure aggregation stopped at '{stage}': {remaining} node(s) remain, the threshold is 3"
    )


def by_hand(updates, weights, setup, tamper=lambda stage, nid, payload: payload):
    """The four stages called one by one, each node's state going through a ConfigRecord between
    them as it does through a node's context state: (aggregate, clipped count per node). `tamper`
    may change what a node sends at a stage (its shares, or its unmask reply)."""
    states, keys = {}, {}
    for nid in updates:
        state, keys[nid] = secagg.node_setup(nid, setup)
        states[nid] = ConfigRecord(state.to_record())
    server, keys = secagg_server.server_keys(setup, keys)
    sent = {}
    for nid in keys:
        state, texts, commitments = secagg.node_share_keys(NodeState.from_record(dict(states[nid])), keys)
        sent[nid] = tamper("share keys", nid, texts), commitments
        states[nid] = ConfigRecord(state.to_record())
    server, routed = secagg_server.server_route_shares(server, sent)
    vectors, clipped = {}, {}
    for nid, got in routed.items():
        state = NodeState.from_record(dict(states[nid]))
        texts, commitments = {s: c for s, (c, _) in got.items()}, {s: h for s, (_, h) in got.items()}
        state, vectors[nid], clipped[nid] = secagg.node_mask(state, texts, updates[nid], weights[nid], commitments)
        states[nid] = ConfigRecord(state.to_record())
    reported = {nid: list(NodeState.from_record(dict(states[nid])).reported) for nid in vectors}
    server, request = secagg_server.server_collect_masked(server, vectors, reported)
    shares = {
        nid: tamper("unmask", nid, secagg.node_unmask(NodeState.from_record(dict(states[nid])), *request)[1])
        for nid in request[0]
    }
    return secagg_server.server_aggregate(server, shares), clipped


def test_a_node_that_reveals_a_wrong_share_is_named_and_the_round_completes_without_its_shares():
    """Issue 51: a wrong Shamir share at unmask stopped the round ("do not rebuild"), every round:
    each owner committed to its shares at share keys, so the server traces the wrong one to its sender."""
    updates, weights = round_inputs(5, 100, 8.0)
    setup = SecAggSetup.for_nodes(5)

    def lie(stage, nid, payload):
        return (
            {o: share[:-1] + bytes([share[-1] ^ 1]) for o, share in payload.items()}
            if (stage, nid) == ("unmask", 2)
            else payload
        )

    result, _ = by_hand(updates, weights, setup, lie)
    assert (result.survivors, result.dropped, result.cheaters) == ((1, 2, 3, 4, 5), (), (2,))
    assert np.abs(result.mean - weighted_mean(updates, weights, updates)).max() <= bound(setup, weights, updates)


def test_a_node_whose_shares_do_not_open_is_dropped_and_the_others_round_completes():
    """Issue 51: random ciphertexts from one node made every other refuse to mask; now each reports
    it, the server drops it alone and removes no mask the reporters never added."""
    updates, weights = round_inputs(5, 100, 8.0)
    setup = SecAggSetup.for_nodes(5)

    def garble(stage, nid, payload):
        return (
            {dst: os.urandom(len(text)) for dst, text in payload.items()}
            if (stage, nid) == ("share keys", 3)
            else payload
        )

    result, _ = by_hand(updates, weights, setup, garble)
    assert (result.survivors, result.dropped, result.cheaters) == ((1, 2, 4, 5), (3,), ())
    others = [1, 2, 4, 5]
    assert np.abs(result.mean - weighted_mean(updates, weights, others)).max() <= bound(setup, weights, others)


def test_clipped_values_are_counted_by_each_node_and_summed_for_the_server():
    setup = SecAggSetup.for_nodes(3, clip=1.0, bits=16)
    updates = {nid: np.zeros(200) for nid in (1, 2, 3)}
    updates[1][:7], updates[2][:3], updates[2][10] = 5.0, -2.0, 0.999
    weights = dict.fromkeys(updates, setup.max_weight)  # r = 1: the update is quantized as it is
    result, clipped = by_hand(updates, weights, setup)
    assert clipped == {1: 7, 2: 3, 3: 0} and result.clipped == 10
    assert result.mean[:3] == pytest.approx((1.0 - 1.0 + 0.0) / 3, abs=1e-3)  # 5 and -2 count as 1 and -1
    assert result.mean[10] == pytest.approx(0.999 / 3, abs=1e-3)


def test_the_stages_run_with_each_nodes_state_kept_in_a_config_record():
    updates, weights = round_inputs(3, 300, 8.0, seed=3)
    setup = SecAggSetup.for_nodes(3)
    result, _ = by_hand(updates, weights, setup)
    assert np.abs(result.mean - weighted_mean(updates, weights, updates)).max() <= bound(setup, weights, updates)


def masked_node(nid=1, num_nodes=3):
    """Node `nid` after it sent its masked vector in a round of `num_nodes`, with nothing else of the round."""
    setup = SecAggSetup.for_nodes(num_nodes)
    pairs = [secagg.node_setup(n, setup) for n in range(1, num_nodes + 1)]
    keys = {n: own for n, (_, own) in enumerate(pairs, 1)}
    shared = {n: secagg.node_share_keys(state, keys) for n, (state, _) in enumerate(pairs, 1)}
    routed = {src: sent[nid] for src, (_, sent, _) in shared.items() if src != nid}
    return secagg.node_mask(shared[nid][0], routed, np.ones(4), 1.0)[0]


def test_a_node_never_gives_both_shares_of_one_node_nor_answers_unmask_twice():
    state = masked_node()
    with pytest.raises(ValueError, match=r"node 1 was asked for both shares of \[2\]: refusing"):
        secagg.node_unmask(state, [1, 2, 3], [2])
    state, reply = secagg.node_unmask(state, [1, 2], [3])
    assert sorted(reply) == [1, 2, 3]
    with pytest.raises(ValueError, match="node 1 asked for 'unmask' after 'unmask'"):
        secagg.node_unmask(state, [1, 2], [3])


@pytest.mark.parametrize(
    ("num_nodes", "kw", "message"),
    [
        (4, {"threshold": 2}, "threshold 2 must be more than half of the 4 nodes .* use 3"),
        (4, {"threshold": 5}, "threshold 5 must be more than half of the 4 nodes"),
        (1100, {"bits": 22}, "22 bits over 1100 nodes overflow the 2\\^32 field: use at most 21"),
        (3, {"clip": 0.0}, "clip > 0"),
    ],
)
def test_a_setup_that_would_leak_or_overflow_is_refused_in_one_line(num_nodes, kw, message):
    with pytest.raises(ValueError, match=message) as refused:
        SecAggSetup.for_nodes(num_nodes, **kw)
    assert "\n" not in str(refused.value)


def test_an_update_the_field_cannot_hold_is_refused_in_one_line():
    setup = SecAggSetup.for_nodes(3)
    state = secagg.node_setup(1, setup)[0]
    for update, weight, message in [
        (np.array([1.0, np.nan]), 1.0, "the update has 1 non-finite value"),
        (np.ones((2, 2)), 1.0, "takes a flat vector"),
        (np.ones(2), 2000.0, r"weight 2000.0 is outside \(0, max-weight 1000.0\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            secagg._quantize(state.setup, update, weight)


def test_a_node_reports_shares_it_cannot_open_and_refuses_a_node_it_has_no_keys_of():
    """Issue 51: a node that cannot open a peer's shares (or finds them unlike the peer's commitment)
    reports the peer and masks without it, where it refused to mask at all."""
    setup = SecAggSetup.for_nodes(3)
    pairs = [secagg.node_setup(n, setup) for n in (1, 2, 3)]
    keys = {n: own for n, (_, own) in enumerate(pairs, 1)}
    shared = {n: secagg.node_share_keys(state, keys) for n, (state, _) in enumerate(pairs, 1)}
    state = shared[1][0]
    with pytest.raises(ValueError, match=r"node 1 got shares from unknown node\(s\) \[9\]"):
        secagg.node_mask(state, {2: shared[2][1][1], 9: b"x"}, np.ones(4), 1.0)
    commitments = {src: shared[src][2][1] for src in (2, 3)}
    for text_of_3 in (shared[2][1][3], b"x" * 100, shared[3][1][1]):  # 2's, meant for 3; garbage; 3's own
        bad = commitments | ({3: bytes(64)} if text_of_3 == shared[3][1][1] else {})  # the last: a broken commitment
        masked = secagg.node_mask(state, {2: shared[2][1][1], 3: text_of_3}, np.ones(4), 1.0, bad)[0]
        assert (masked.reported, masked.peers, sorted(masked.shares)) == ((3,), (2,), [1, 2])


def test_a_node_refuses_to_share_under_a_threshold_that_is_no_majority_of_the_keys_it_was_sent():
    unsafe = SecAggSetup(threshold=2)  # as a server that skipped `check` would send to 4 nodes
    pairs = [secagg.node_setup(n, unsafe) for n in (1, 2, 3, 4)]
    keys = {n: own for n, (_, own) in enumerate(pairs, 1)}
    with pytest.raises(ValueError, match="threshold 2 must be more than half of the 4 nodes"):
        secagg.node_share_keys(pairs[0][0], keys)


def test_masks_are_keyed_by_the_whole_seed_and_uniform_over_the_field():
    seed = bytes(range(32))
    other = bytes([seed[0] ^ 1]) + seed[1:]  # one byte differs
    # Flower's generator folds a seed into the XOR of its 4-byte words: swapping two words kept its masks
    swapped = seed[4:8] + seed[:4] + seed[8:]
    mask = secagg.expand_mask(seed, 100_000)
    assert np.array_equal(mask, secagg.expand_mask(seed, 100_000))
    for changed in (other, swapped):
        assert np.count_nonzero(mask == secagg.expand_mask(changed, 100_000)) < 10
    assert mask.min() >= 0 and mask.max() < 2**32 and mask.dtype == np.int64
    assert abs(mask.mean() / 2**32 - 0.5) < 0.005 and abs(mask.std() / 2**32 - 12**-0.5) < 0.005
    assert np.array_equal(secagg.expand_mask(base64.urlsafe_b64encode(seed), 10), mask[:10])  # a pairwise key's form


def test_a_dropped_nodes_mask_key_is_rebuilt_from_shares_of_its_scalar_and_checked_against_its_public_key():
    (state, (mask_public, _)), (other, _) = (
        secagg.node_setup(1, SecAggSetup.for_nodes(3)),
        secagg.node_setup(2, SecAggSetup.for_nodes(3)),
    )
    secret = secagg.mask_secret(state.mask_key)
    shares = secagg.create_shares(secret, 2, 3)
    assert len(shares[0]) == 4 + 4 * 16  # the 48-byte scalar padded to 4 Shamir chunks (the PEM text: 20)
    rebuilt = shamir.combine(shares[1:])
    assert secagg.mask_key_of(rebuilt, mask_public) == state.mask_key
    peer = {2: other.own_keys[0]}
    assert secagg.agreed_keys(secagg.mask_key_of(rebuilt, mask_public), peer) == secagg.agreed_keys(
        state.mask_key, peer
    )
    # another node's scalar is a valid key, but not this node's: removing its masks would be wrong, silently
    with pytest.raises(ValueError, match="not the one the node published"):
        secagg.mask_key_of(secagg.mask_secret(other.mask_key), mask_public)
    with pytest.raises(ValueError):  # zero is no private key
        secagg.mask_key_of(bytes(48), mask_public)


def test_a_node_that_shares_another_keys_scalar_and_drops_stops_the_round_naming_it(monkeypatch):
    """The node itself lies, one step beside a holder that reveals a wrong share (which commitments
    catch): it shares a valid scalar that is not its mask key's, then drops. Its shares rebuild that
    scalar; removing the masks it would give is refused, where the old PEM sharing took any valid key."""
    impostor = secagg.mask_secret(secagg.node_setup(9, SecAggSetup.for_nodes(5))[0].mask_key)
    honest = secagg.mask_secret

    def lying(mask_key: bytes) -> bytes:
        return impostor if mask_key == states[2] else honest(mask_key)

    states: dict[int, bytes] = {}
    setup = secagg.node_setup

    def remembered(node_id, s):
        state, keys = setup(node_id, s)
        states[node_id] = state.mask_key
        return state, keys

    monkeypatch.setattr(secagg, "mask_secret", lying)
    monkeypatch.setattr(secagg_server, "node_setup", remembered)
    updates, weights = round_inputs(5, 100, 8.0, seed=3)
    with pytest.raises(ValueError, match="the shares of node 2 do not rebuild its key"):
        secagg_server.simulate(updates, weights, SecAggSetup.for_nodes(5), leave={"collect masked vectors": {2}})
    # the same round with node 2 honest completes without it
    monkeypatch.setattr(secagg, "mask_secret", honest)
    result = secagg_server.simulate(updates, weights, SecAggSetup.for_nodes(5), leave={"collect masked vectors": {2}})
    assert result.dropped == (2,)
