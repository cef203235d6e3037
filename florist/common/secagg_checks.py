"""What the server of a secure round checks a node by (florist/common/secagg.py): the commitments
each node makes to its Shamir shares, so that a wrong share revealed at unmask names its sender,
and the ranges honest nodes' unmasked sums lie in, so that a node that adds to its masked vector
stops the round instead of moving the model (docs/secure-aggregation.md, "What one node can
corrupt")."""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from florist.common.secagg import SecAggSetup

log = logging.getLogger("flwr").getChild(__name__)


def commit(owner: int, holder: int, pair: tuple[bytes, bytes]) -> bytes:
    """SHA-256 of each of `owner`'s two shares for `holder` (seed, mask key), bound to both ids: 64
    bytes. A share of a random secret is itself random, so the digest tells nothing of it."""
    return b"".join(digest(owner, holder, kind, share) for kind, share in enumerate(pair))


def digest(owner: int, holder: int, kind: int, share: bytes) -> bytes:
    """One share's half of `commit`: kind 0 a seed share, 1 a mask-key share."""
    return hashlib.sha256(b"florist-secagg:%d:%d:%d:" % (owner, holder, kind) + share).digest()


def as_committed(
    commitments: dict[int, dict[int, bytes]], survivors: tuple[int, ...], holder: int, reply: dict[int, bytes]
) -> bool:
    """Whether every share `holder` revealed (owner -> share: a seed share of a survivor, a mask-key
    share of a dropped node) is the one its owner committed to for it (`commitments`: owner ->
    holder -> `commit`). The holder checked them when it opened them (`node_mask`), so a share that
    differs now is the holder's doing."""
    for owner, share in reply.items():
        kind = 0 if owner in survivors else 1
        promised = commitments.get(owner, {}).get(holder, b"")
        if promised[32 * kind : 32 * (kind + 1)] != digest(owner, holder, kind, share):
            log.warning("secure aggregation: node %s revealed a share of node %s it was not sent", holder, owner)
            return False
    return True


def check_sums(setup: SecAggSetup, total: np.ndarray, weights: list[tuple[float, float]]) -> None:
    """Refuse unmasked sums that honest nodes cannot produce: one node that adds to its masked vector
    moves the sum anywhere in the field (1 − n·2^b in the weight slot shrinks the divisor to one
    step; 2^31 on the values moves every value by half the field). Each node quantizes its weight to
    [max(1, q(least)), q(most)] (`weights`: per survivor), its clipped count and each value to
    [0, 2^b]: sums outside n such ranges are refused in one line. A shift that keeps every sum in
    range is not seen (docs/secure-aggregation.md)."""
    levels, n = 2**setup.bits, len(weights)
    low = sum(max(1, round(w / setup.max_weight * levels)) for w, _ in weights)
    high = sum(round(w / setup.max_weight * levels) for _, w in weights)
    if not low <= int(total[0]) <= high:
        expected = f"{low}" if low == high else f"between {low} and {high}"
        raise ValueError(
            f"secure aggregation: the unmasked weight sum is {int(total[0])} step(s) where the {n} survivors'"
            f" weights make {expected}: a node altered its masked vector; nothing is aggregated"
        )
    if (beyond := int(np.count_nonzero(total[1:] > n * levels))) > 0:
        raise ValueError(
            f"secure aggregation: {beyond} unmasked value(s) lie beyond the {n} survivors' range [0, {n * levels}]"
            " steps: a node altered its masked vector; nothing is aggregated"
        )
