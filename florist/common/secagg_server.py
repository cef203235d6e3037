"""Secure aggregation's server side (florist/common/secagg.py has the protocol and the node's
side): route the keys and shares, collect the masked vectors, rebuild the dropped nodes' masks and
the survivors' self masks, and check the unmasked sum; `simulate` runs the four stages in one process,
the reference the exchanges follow."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
from flwr.common.secure_aggregation.quantization import dequantize

from florist.common import secagg_checks as checks
from florist.common import shamir
from florist.common.secagg import (
    HEADER,
    MODULUS,
    STAGES,
    Aggregate,
    KeyPair,
    NodeState,
    SecAggSetup,
    ServerState,
    agreed_keys,
    check_enough,
    check_known,
    expand_mask,
    mask_key_of,
    node_mask,
    node_setup,
    node_share_keys,
    node_unmask,
)

log = logging.getLogger("flwr").getChild(__name__)


# ---- server side --------------------------------------------------------------------------------


def server_keys(setup: SecAggSetup, replies: dict[int, KeyPair]) -> tuple[ServerState, dict[int, KeyPair]]:
    """Stage 2 out: every node that answered setup gets every public key (a full graph)."""
    check_enough(STAGES[0], len(replies), setup.threshold)
    return ServerState(setup, dict(replies)), dict(replies)


def server_route_shares(
    state: ServerState, replies: dict[int, tuple[dict[int, bytes], dict[int, bytes]]]
) -> tuple[ServerState, dict[int, dict[int, tuple[bytes, bytes]]]]:
    """Stage 3 out: each node that shared (its ciphertexts and commitments, by holder) gets, from
    every other that did, the ciphertext addressed to it and the sender's commitment to what it
    holds (recipient -> sender -> (ciphertext, commitment)); the server cannot read the ciphertexts,
    and keeps the commitments to check the shares revealed at unmask."""
    check_known(replies, state.public_keys, STAGES[1])
    sharers = tuple(sorted(replies))
    check_enough(STAGES[1], len(sharers), state.setup.threshold)
    for src, (sent, commitments) in replies.items():
        if set(sent) != set(state.public_keys) - {src} or set(commitments) != set(state.public_keys):
            raise ValueError(f"secure aggregation: node {src} sent shares for {sorted(sent)}, not for all others")
    routed = {
        dst: {src: (replies[src][0][dst], replies[src][1][dst]) for src in sharers if src != dst} for dst in sharers
    }
    commitments = {src: replies[src][1] for src in sharers}
    return dataclasses.replace(state, sharers=sharers, commitments=commitments), routed


def server_collect_masked(
    state: ServerState, vectors: dict[int, np.ndarray], reported: dict[int, list[int]] | None = None
) -> tuple[ServerState, tuple[list[int], list[int]]]:
    """Stage 4 out: the sum of the masked vectors, and the request every survivor gets: (survivors,
    dropped). A node another `reported` (sender -> the nodes whose shares it could not open) is
    dropped, its vector left out; the masks towards it are removed where they were added."""
    check_known(vectors, state.sharers, STAGES[2])
    reported = {n: set(reported.get(n, ())) & set(state.sharers) if reported else set() for n in vectors}
    accused = set().union(*reported.values())
    vectors = {n: v for n, v in vectors.items() if n not in accused}
    survivors = tuple(sorted(vectors))
    check_enough(STAGES[2], len(survivors), state.setup.threshold)
    total = np.zeros(len(vectors[survivors[0]]), dtype=np.int64)
    for nid in survivors:
        v = np.asarray(vectors[nid])
        if v.shape != total.shape or v.shape[0] <= HEADER or v.dtype != np.uint32:
            raise ValueError(
                f"secure aggregation: node {nid} sent a {v.dtype} vector of shape {v.shape}, not {total.shape} uint32"
            )
        total += v
    dropped = [n for n in state.sharers if n not in vectors]
    peers = {n: tuple(sorted(set(state.sharers) - {n} - reported[n])) for n in survivors}
    state = dataclasses.replace(state, survivors=survivors, peers=peers, masked_sum=np.mod(total, MODULUS))
    return state, (list(survivors), dropped)


def server_aggregate(
    state: ServerState, replies: dict[int, dict[int, bytes]], weights: dict[int, tuple[float, float]] | None = None
) -> Aggregate:
    """Stage 4 in: rebuild each survivor's self-mask seed and each dropped node's mask key from the
    shares (owner -> share, per answering survivor), remove the masks, check the sums (`secagg_checks.check_sums`;
    `weights`: each survivor's least and most weight, default (0, W)), and divide the weighted sum by
    the weight sum: Σ w·x / Σ w."""
    check_known(replies, state.survivors, STAGES[3])
    t = state.setup.threshold
    dropped = tuple(n for n in state.sharers if n not in state.survivors)
    cheaters = tuple(
        h
        for h, reply in sorted(replies.items())
        if not checks.as_committed(state.commitments, state.survivors, h, reply)
    )
    replies = {h: reply for h, reply in replies.items() if h not in cheaters}
    check_enough(STAGES[3], len(replies), t)
    total = state.masked_sum.copy()
    masked_with = {n for peers in state.peers.values() for n in peers}
    for owner in (n for n in state.sharers if n in state.survivors or n in masked_with):  # a node all reported: no mask
        secret = _rebuild(owner, [reply[owner] for reply in replies.values() if owner in reply], t)
        if owner in dropped:
            _remove_pairwise(total, owner, secret, state)
        else:
            total -= expand_mask(secret, total.size)
    total = np.mod(total, MODULUS)
    levels, clip = 2**state.setup.bits, state.setup.clip
    checks.check_sums(
        state.setup, total, [(weights or {}).get(n, (0.0, state.setup.max_weight)) for n in state.survivors]
    )
    q_weight, clipped = int(total[0]), int(total[1])
    sums = dequantize([total[HEADER:]], clip, levels)[0] - (len(state.survivors) - 1) * clip
    weight_sum = q_weight / levels * state.setup.max_weight
    return Aggregate(sums * (levels / q_weight), weight_sum, clipped, state.survivors, dropped, cheaters)


def _rebuild(owner: int, shares: list[bytes], t: int) -> bytes:
    """Node `owner`'s secret from t of its shares (more add nothing but time)."""
    check_enough(f"{STAGES[3]}: shares of node {owner}", len(shares), t)
    try:
        return shamir.combine(shares[:t])
    except ValueError:
        raise ValueError(f"secure aggregation: the shares of node {owner} do not rebuild its secret") from None


def _remove_pairwise(total: np.ndarray, dropped: int, secret: bytes, state: ServerState) -> None:
    """Undo, in place, the pairwise mask each survivor added towards a dropped node (the server
    rebuilt its key's scalar, `secret`)."""
    try:
        mask_key = mask_key_of(secret, state.public_keys[dropped][0])
        seeds = agreed_keys(mask_key, {survivor: state.public_keys[survivor][0] for survivor in state.survivors})
    except ValueError:
        raise ValueError(f"secure aggregation: the shares of node {dropped} do not rebuild its key") from None
    for survivor, seed in seeds.items():
        if dropped not in state.peers[survivor]:  # it reported the dropped node: it added no mask towards it
            continue
        pairwise = expand_mask(seed, total.size)
        total += -pairwise if survivor > dropped else pairwise


# ---- the four stages in one process -------------------------------------------------------------

Spy = Callable[[str, int, int, object], None]  # (stage, sender, recipient, payload); node 0 is the server


def simulate(
    updates: dict[int, np.ndarray],
    weights: dict[int, float],
    setup: SecAggSetup,
    *,
    leave: dict[str, set[int]] | None = None,
    spy: Spy | None = None,
) -> Aggregate:
    """The four stages in order with every node in this process: the reference the exchanges follow.
    `leave` names, per stage, nodes that stop answering from that stage on; `spy` sees every payload."""
    leave, spy, gone, states = leave or {}, spy or (lambda *_: None), set(), {}

    def stage(name: str, requests: dict[int, object], answer: Callable) -> dict[int, object]:
        gone.update(leave.get(name, ()))
        replies = {}
        for nid in sorted(set(requests) - gone):
            spy(name, 0, nid, requests[nid])
            states[nid], replies[nid] = answer(nid, requests[nid])
            spy(name, nid, 0, replies[nid])
        return replies

    keys = stage(STAGES[0], dict.fromkeys(updates, setup), node_setup)
    server, keys = server_keys(setup, keys)

    def share(n: int, got: dict[int, KeyPair]) -> tuple[NodeState, tuple[dict[int, bytes], dict[int, bytes]]]:
        state, sent, commitments = node_share_keys(states[n], got)
        return state, (sent, commitments)

    def mask(n: int, got: dict[int, tuple[bytes, bytes]]) -> tuple[NodeState, np.ndarray]:
        texts, commitments = {s: c for s, (c, _) in got.items()}, {s: h for s, (_, h) in got.items()}
        return node_mask(states[n], texts, updates[n], weights[n], commitments)[:2]

    sent = stage(STAGES[1], dict.fromkeys(keys, keys), share)
    server, routed = server_route_shares(server, sent)
    masked = stage(STAGES[2], routed, mask)
    server, request = server_collect_masked(server, masked, {n: list(states[n].reported) for n in masked})
    shares = stage(STAGES[3], dict.fromkeys(masked, request), lambda n, got: node_unmask(states[n], *got))
    return server_aggregate(server, shares)
