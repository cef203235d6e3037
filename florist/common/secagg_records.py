"""Secure aggregation's messages as Flower records: what each stage's request and reply carry
(`florist/common/secagg.py` computes it), under one ConfigRecord key, `secagg`, beside the usual
records. Both halves use these functions, so the two sides cannot disagree on a key; every
reading checks types and lengths and raises `protocol.ProtocolError` in one line, naming the node.

In a round, nodes are numbered 1..n in the order of their Flower node ids (SecAgg's node ids:
small, so that they fit where Flower's 64-bit ids would not, in a ConfigRecord's signed ints).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.supercore.primitives import asymmetric

from florist.common.protocol import ProtocolError
from florist.common.secagg import KeyPair, SecAggSetup

SECAGG = "secagg"  # the ConfigRecord of every stage's request and reply; the masked vector's ArrayRecord
MASKED = "masked"  # the masked vector's key in that ArrayRecord (uint32)
REPORTED = "secagg-reported"  # a train reply's ConfigRecord: the nodes whose shares it could not open
LOSS_RANGE = 100.0  # the train loss travels as loss · c / LOSS_RANGE: within [-c, c] up to this loss


def tail(dp: str) -> tuple[str, ...]:
    """What a masked vector carries after the update's values: the train loss, of which the server
    learns the weighted mean; under any `dp` nothing: an exact sum of losses (or of the clipped and
    diverged flags) is data-dependent and un-noised, which no ε accounts for."""
    return ("train-loss",) if dp == "none" else ()


def put(content: RecordDict, **values: object) -> RecordDict:
    """`content` with `values` as its `secagg` ConfigRecord."""
    content[SECAGG] = ConfigRecord(dict(values))
    return content


def read(content: RecordDict, source: str, **kinds: type) -> dict[str, object]:
    """The `secagg` values of a message named in `kinds`, each present and of its kind (a list's
    items are the caller's to check); with no `kinds`, only that the record is there."""
    record = content.config_records.get(SECAGG)
    if record is None:
        raise ProtocolError(f"{source}: message has no {SECAGG!r} ConfigRecord")
    out = {}
    for key, kind in kinds.items():
        value = record.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ProtocolError(f"{source}: {SECAGG} {key!r} is not a {kind.__name__}")
        out[key] = value
    return out


def id_values(values: Mapping[int, bytes]) -> dict[str, list]:
    """`{id: bytes}` (ciphertexts by node, shares by owner) as two lists of one length; `by_id` reads them."""
    return {"ids": [int(i) for i in values], "values": list(values.values())}


def by_id(content: RecordDict, source: str) -> dict[int, bytes]:
    """The `{id: bytes}` `id_values` wrote: ids distinct whole numbers, as many as the values, each bytes."""
    got = read(content, source, ids=list, values=list)
    ids, values = got["ids"], got["values"]
    if len(ids) != len(values) or not all(type(i) is int for i in ids) or len(set(ids)) != len(ids):
        raise ProtocolError(f"{source}: {SECAGG} 'ids' are not distinct whole numbers, one per value")
    if not all(isinstance(v, bytes) for v in values):
        raise ProtocolError(f"{source}: {SECAGG} 'values' are not all byte strings")
    return dict(zip(ids, values))


def commitments_values(commitments: Mapping[int, bytes]) -> dict[str, list]:
    """A share-keys reply's commitments (`secagg.commit`), by holder, beside its ciphertexts."""
    return {"commit-ids": [int(i) for i in commitments], "commits": list(commitments.values())}


def commitments_of(content: RecordDict, source: str) -> dict[int, bytes]:
    """The commitments `commitments_values` wrote: distinct whole-number ids, each a 64-byte digest pair."""
    got = read(content, source, **{"commit-ids": list, "commits": list})
    ids, commits = got["commit-ids"], got["commits"]
    if len(ids) != len(commits) or not all(type(i) is int for i in ids) or len(set(ids)) != len(ids):
        raise ProtocolError(f"{source}: {SECAGG} 'commit-ids' are not distinct whole numbers, one per commitment")
    if not all(isinstance(c, bytes) and len(c) == 64 for c in commits):
        raise ProtocolError(f"{source}: {SECAGG} 'commits' are not all 64-byte digests")
    return dict(zip(ids, commits))


def routed_values(routed: Mapping[int, tuple[bytes, bytes]]) -> dict[str, list]:
    """A train request's shares: each sender's ciphertext for the node and its commitment to them."""
    return id_values({i: text for i, (text, _) in routed.items()}) | {"commits": [c for _, c in routed.values()]}


def routed_of(content: RecordDict, source: str) -> tuple[dict[int, bytes], dict[int, bytes]]:
    """(ciphertexts, commitments) by sender, as `routed_values` wrote them."""
    texts = by_id(content, source)
    commits = read(content, source, commits=list)["commits"]
    if len(commits) != len(texts) or not all(isinstance(c, bytes) for c in commits):
        raise ProtocolError(f"{source}: {SECAGG} 'commits' are not {len(texts)} byte strings")
    return texts, dict(zip(texts, commits))


def reported_record(reported: list[int]) -> ConfigRecord:
    """A train reply's `secagg-reported`: the senders whose shares the node could not open."""
    return ConfigRecord({"ids": [int(i) for i in reported]})


def reported_of(content: RecordDict, source: str) -> list[int]:
    """The ids `reported_record` wrote (none when it is absent)."""
    record = content.config_records.get(REPORTED)
    ids = [] if record is None else record.get("ids", [])
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise ProtocolError(f"{source}: {REPORTED} 'ids' are not whole numbers")
    return ids


def setup_values(node_id: int, setup: SecAggSetup) -> dict[str, object]:
    """What the setup request carries: the node's SecAgg id and the round's setup."""
    return {"node-id": node_id} | {k.replace("_", "-"): v for k, v in dataclasses.asdict(setup).items()}


def setup_of(content: RecordDict, source: str) -> tuple[int, SecAggSetup]:
    """(the node's SecAgg id, the setup) of a setup request."""
    got = read(content, source, **{"node-id": int, "threshold": int, "clip": float, "bits": int, "max-weight": float})
    return got["node-id"], SecAggSetup(got["threshold"], got["clip"], got["bits"], got["max-weight"])


def keys_values(keys: Mapping[int, KeyPair]) -> dict[str, list]:
    """Public key pairs by node (a setup reply's one, the share-keys request's all): mask keys as the
    values, encryption keys beside them."""
    return id_values({i: a for i, (a, _) in keys.items()}) | {"crypt-keys": [b for _, b in keys.values()]}


def noise_of(content: RecordDict, source: str) -> float:
    """A train request's `dp-sigma`: under `dp = "distributed"`, the noise multiplier σ the nodes'
    noise shares make up (florist/common/privacy.py's `share_std`); 0 otherwise."""
    sigma = read(content, source, **{"dp-sigma": float})["dp-sigma"]
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ProtocolError(f"{source}: {SECAGG} 'dp-sigma' must be a finite number >= 0, got {sigma}")
    return sigma


def keys_of(content: RecordDict, source: str) -> dict[int, KeyPair]:
    """The public key pairs `keys_values` wrote."""
    masks = by_id(content, source)
    crypts = read(content, source, **{"crypt-keys": list})["crypt-keys"]
    if len(crypts) != len(masks) or not all(isinstance(c, bytes) for c in crypts):
        raise ProtocolError(f"{source}: {SECAGG} 'crypt-keys' are not {len(masks)} byte strings")
    for key in (*masks.values(), *crypts):  # one that does not load would stop every other node's next stage
        try:
            asymmetric.bytes_to_public_key(key)
        except (ValueError, TypeError):
            raise ProtocolError(f"{source}: {SECAGG} holds a public key that does not load") from None
    return {i: (m, c) for (i, m), c in zip(masks.items(), crypts)}


def unmask_values(survivors: list[int], dropped: list[int]) -> dict[str, list]:
    return {"survivors": list(survivors), "dropped": list(dropped)}


def unmask_of(content: RecordDict, source: str) -> tuple[list[int], list[int]]:
    """(survivors, dropped) of an unmask request."""
    got = read(content, source, survivors=list, dropped=list)
    if not all(type(i) is int for i in got["survivors"] + got["dropped"]):
        raise ProtocolError(f"{source}: {SECAGG} survivors and dropped are not whole numbers")
    return got["survivors"], got["dropped"]


def flatten(delta: Mapping[str, np.ndarray]) -> np.ndarray:
    """A model's update as one float64 vector, its tensors in key order (`unflatten` undoes it)."""
    return np.concatenate([np.asarray(delta[key], dtype=np.float64).ravel() for key in sorted(delta)])


def unflatten(vector: np.ndarray, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """`flatten`'s vector as arrays of `shapes`, by key."""
    out, at = {}, 0
    for key in sorted(shapes):
        size = int(np.prod(shapes[key]))
        out[key], at = vector[at : at + size].reshape(shapes[key]), at + size
    return out


def masked_record(vector: np.ndarray) -> ArrayRecord:
    return ArrayRecord({MASKED: Array(np.ascontiguousarray(vector, dtype=np.uint32))})
