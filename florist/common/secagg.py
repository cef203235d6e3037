"""Secure aggregation (SecAgg+: Bonawitz et al. 2017, Bell et al. 2020) as plain functions: the
math of the protocol's four stages for a node (`node_*`; the server's `server_*` are in
florist/common/secagg_server.py), every state passed in and out, nothing sent from here.

Why not Flower's `SecAggPlusWorkflow`: it drives Flower's legacy strategies only. florist runs the
stages (setup, share keys, collect masked vectors, unmask) as exchanges of its own round, so that
they work wherever a round does. The cryptography is Flower's SecAgg+ primitives (Shamir shares,
ECDH key agreement, Fernet encryption, quantization) and ChaCha20 for the masks: none is new here
(the server rebuilds shares with florist/common/shamir.py, which gives Flower's result faster).
A node sends y = [q(w), clipped, q(w/W · x)] + self mask ± a pairwise mask per other node, mod
2^32; the server learns Σ w·x / Σ w. Every node is every other's neighbour (a full graph, SecAgg's
original form; SecAgg+'s sparse graph is not built yet). Each node commits to its shares, so that a
wrong one revealed is traced to its sender, and reports a peer whose shares it cannot open
(florist/common/secagg_checks.py). docs/secure-aggregation.md has the stages as a table, what the
server learns, what one node can corrupt and the dropout rule; `secagg_server.simulate` runs them in order.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
from dataclasses import dataclass, field

import numpy as np
from cryptography.fernet import InvalidToken
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from flwr.common.secure_aggregation.crypto.shamir import create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
from flwr.common.secure_aggregation.quantization import quantize
from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat, share_keys_plaintext_separate
from flwr.supercore.primitives import asymmetric

from florist.common import secagg_checks as checks

log = logging.getLogger("flwr").getChild(__name__)

MODULUS = 2**32  # the field every masked value lives in (Flower's default modulus): a uint32 each
HEADER = 2  # a masked vector's first values: the quantized weight, the clipped count
STAGES = ("setup", "share keys", "collect masked vectors", "unmask")
KeyPair = tuple[bytes, bytes]  # (mask key, encryption key) public halves; or (seed, mask key) shares


class BelowThreshold(ValueError):
    """Too few nodes remain to rebuild the secrets: the round stops (the run resumes like any other)."""

    def __init__(self, stage: str, remaining: int, threshold: int):
        super().__init__(
            f"secure aggregation stopped at '{stage}': {remaining} node(s) remain, the threshold is {threshold}"
        )
        self.stage, self.remaining, self.threshold = stage, remaining, threshold


@dataclass(frozen=True)
class SecAggSetup:
    """What the server sends at setup, the same to every node of the round (defaults: Flower's)."""

    threshold: int  # t: shares that rebuild a node's secret; more than half the round's nodes
    clip: float = 8.0  # values of w/W·x outside [-clip, clip] are clipped, and counted
    bits: int = 22  # 2**bits quantization steps over [-clip, clip]
    max_weight: float = 1000.0  # W: each node's weight lies in (0, W]

    @classmethod
    def for_nodes(cls, num_nodes: int, threshold: int | None = None, **kw: float) -> SecAggSetup:
        """The setup for a round of `num_nodes` (threshold: a majority unless given), checked."""
        setup = cls(num_nodes // 2 + 1 if threshold is None else threshold, **kw)
        setup.check(num_nodes)
        return setup

    def check(self, num_nodes: int) -> None:
        """Refuse, in one line, a threshold that would let the server unmask a node, and a quantization
        whose sum over the round's nodes would wrap around the field."""
        t = self.threshold
        if num_nodes < 2:
            raise ValueError(f"secure aggregation needs at least 2 nodes, the round has {num_nodes}")
        if not num_nodes // 2 < t <= num_nodes:
            raise ValueError(
                f"secure-aggregation threshold {t} must be more than half of the {num_nodes} nodes and at most"
                f" all of them (at half or under, a server could get both secrets of a node): use {num_nodes // 2 + 1}"
            )
        if not (np.isfinite(self.clip) and self.clip > 0 and self.max_weight > 0 and self.bits >= 1):
            raise ValueError(f"secure aggregation needs clip > 0, max-weight > 0 and bits >= 1, got {self}")
        if num_nodes * 2**self.bits >= MODULUS:
            most = MODULUS.bit_length() - 1 - num_nodes.bit_length()
            raise ValueError(f"{self.bits} bits over {num_nodes} nodes overflow the 2^32 field: use at most {most}")


@dataclass(frozen=True)
class NodeState:
    """A node's secrets and progress between the stages: the node keeps it, nothing of it is sent."""

    node_id: int
    setup: SecAggSetup
    stage: str  # the last stage this node answered
    mask_key: bytes  # private key (PEM) of the pairwise masks: its scalar is Shamir-shared, rebuilt if the node drops
    crypt_key: bytes  # private key (PEM) that encrypts the shares this node sends
    own_keys: KeyPair  # the public halves of both, as this node sent them
    public_keys: dict[int, KeyPair] = field(default_factory=dict)  # every node's, this one's too
    seed: bytes = b""  # the self-mask seed: Shamir-shared, rebuilt if the node survives
    shares: dict[int, KeyPair] = field(default_factory=dict)  # owner -> (seed share, mask-key share) held
    peers: tuple[int, ...] = ()  # the nodes this node masked with
    reported: tuple[int, ...] = ()  # those whose shares it could not open or that broke their commitments

    def to_record(self) -> dict[str, object]:
        """Flat values a ConfigRecord holds (a node's context state: every message may run in a fresh process)."""
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        flat |= dataclasses.asdict(flat.pop("setup"))
        for name in ("public_keys", "shares"):
            pairs = flat.pop(name)
            flat |= {f"{name}.ids": list(pairs), f"{name}.0": [a for a, _ in pairs.values()]}
            flat[f"{name}.1"] = [b for _, b in pairs.values()]
        return flat | {"own_keys": list(self.own_keys), "peers": list(self.peers), "reported": list(self.reported)}

    @classmethod
    def from_record(cls, flat: dict) -> NodeState:
        """The state `to_record` wrote."""
        pairs = {n: dict(zip(flat[f"{n}.ids"], zip(flat[f"{n}.0"], flat[f"{n}.1"]))) for n in ("public_keys", "shares")}
        setup = SecAggSetup(**{f.name: flat[f.name] for f in dataclasses.fields(SecAggSetup)})
        scalars = {k: flat[k] for k in ("node_id", "stage", "mask_key", "crypt_key", "seed")}
        ids = {k: tuple(flat[k]) for k in ("own_keys", "peers", "reported")}
        return cls(setup=setup, **ids, **scalars, **pairs)


@dataclass(frozen=True)
class ServerState:
    """What the server keeps between the stages: public keys, who is left, the sum of the masked vectors."""

    setup: SecAggSetup
    public_keys: dict[int, KeyPair]  # the nodes that answered setup
    sharers: tuple[int, ...] = ()  # the nodes that shared their keys
    commitments: dict[int, dict[int, bytes]] = field(default_factory=dict)  # owner -> holder -> commitment
    survivors: tuple[int, ...] = ()  # the nodes whose masked vector counts
    peers: dict[int, tuple[int, ...]] = field(default_factory=dict)  # survivor -> the nodes it masked with
    masked_sum: np.ndarray | None = None  # their sum mod 2^32 (int64)


@dataclass(frozen=True)
class Aggregate:
    """What the server learns: the weighted mean, the weight sum, the clipped count, who took part."""

    mean: np.ndarray  # sum of w·x over the survivors / sum of w (float64), within the quantization bound
    weight_sum: float  # sum of the survivors' weights, each rounded to W/2^bits
    clipped: int  # values clipped over all survivors (each node counts at most 2^bits)
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]  # shared keys, sent no masked vector (or were reported): their masks were removed
    cheaters: tuple[int, ...] = ()  # sent shares at unmask their owner's commitments refute: left out


# ---- node side ----------------------------------------------------------------------------------


def node_setup(node_id: int, setup: SecAggSetup) -> tuple[NodeState, KeyPair]:
    """Stage 1: two fresh key pairs, one agreeing the pairwise masks, one encrypting the shares."""
    (mask_sk, mask_pk), (crypt_sk, crypt_pk) = asymmetric.generate_key_pairs(), asymmetric.generate_key_pairs()
    own = (asymmetric.public_key_to_bytes(mask_pk), asymmetric.public_key_to_bytes(crypt_pk))
    keys = asymmetric.private_key_to_bytes(mask_sk), asymmetric.private_key_to_bytes(crypt_sk)
    return NodeState(node_id, setup, STAGES[0], *keys, own_keys=own), own


def node_share_keys(
    state: NodeState, public_keys: dict[int, KeyPair]
) -> tuple[NodeState, dict[int, bytes], dict[int, bytes]]:
    """Stage 2: Shamir-share the mask key and a fresh self-mask seed, t of n, and encrypt each node's
    pair of shares for it (a key agreed from the encryption keys): recipient -> ciphertext; and a
    commitment to each pair (`commit`, holder -> 64 bytes, this node's own too), which lets each
    holder check what it opens and the server check what a holder reveals at unmask."""
    _expect(state, STAGES[1])
    t, me = state.setup.threshold, state.node_id
    if public_keys.get(me) != state.own_keys:
        raise ValueError(f"secure aggregation: node {me} was sent public keys that are not its own: refusing")
    every = [key for pair in public_keys.values() for key in pair]
    if len(set(every)) != len(every):
        raise ValueError(f"secure aggregation: node {me} was sent the same public key twice: refusing")
    check_enough(STAGES[1], len(public_keys), t)
    state.setup.check(len(public_keys))  # a node, too, refuses a threshold that is no majority of those it shares with
    seed, ids = os.urandom(32), sorted(public_keys)
    secrets = create_shares(seed, t, len(ids)), create_shares(mask_secret(state.mask_key), t, len(ids))
    pairs = dict(zip(ids, zip(*secrets)))
    agreed = agreed_keys(state.crypt_key, {peer: public_keys[peer][1] for peer in ids if peer != me})
    sent = {peer: encrypt(key, share_keys_plaintext_concat(me, peer, *pairs[peer])) for peer, key in agreed.items()}
    shares, commitments = {me: pairs[me]}, {holder: checks.commit(me, holder, pair) for holder, pair in pairs.items()}
    state = dataclasses.replace(state, stage=STAGES[1], public_keys=dict(public_keys), seed=seed, shares=shares)
    return state, sent, commitments


def node_mask(
    state: NodeState,
    ciphertexts: dict[int, bytes],
    update: np.ndarray,
    weight: float,
    commitments: dict[int, bytes] | None = None,
    count: bool = True,
) -> tuple[NodeState, np.ndarray, int]:
    """Stage 3: keep the shares the others sent (sender -> ciphertext), then quantize
    [weight, clipped, weight/W · update] and add the self mask and, per sender, a pairwise mask
    (+ towards a smaller id, − towards a larger: they cancel in the sum). A sender whose ciphertext
    does not open, or whose shares break its `commitments` (sender -> `commit`), is reported
    (`NodeState.reported`, for the server to treat as dropped) and not masked with: one node's bad
    shares no longer stop every other. `count` False (under dp): the clipped count sent is 0, an
    exact count being data-dependent and un-noised. Returns the new state, the masked vector (uint32)
    and how many values were clipped."""
    _expect(state, STAGES[2])
    if strangers := sorted(set(ciphertexts) - set(state.public_keys) | set(ciphertexts) & {state.node_id}):
        raise ValueError(f"secure aggregation: node {state.node_id} got shares from unknown node(s) {strangers}")
    keys = agreed_keys(state.crypt_key, {src: state.public_keys[src][1] for src in ciphertexts})
    opened = {src: _opened(state.node_id, src, keys[src], text, commitments) for src, text in ciphertexts.items()}
    shares = state.shares | {src: pair for src, pair in opened.items() if pair is not None}
    reported = tuple(sorted(src for src, pair in opened.items() if pair is None))
    check_enough(STAGES[2], len(shares), state.setup.threshold)
    vector, clipped = _quantize(state.setup, update, weight)
    vector[1] *= count
    vector += expand_mask(state.seed, vector.size)
    peers = tuple(sorted(set(ciphertexts) - set(reported)))
    for peer, seed in sorted(agreed_keys(state.mask_key, {p: state.public_keys[p][0] for p in peers}).items()):
        pairwise = expand_mask(seed, vector.size)
        vector += pairwise if state.node_id > peer else -pairwise
    masked = np.mod(vector, MODULUS).astype(np.uint32)
    state = dataclasses.replace(state, stage=STAGES[2], shares=shares, peers=peers, reported=reported)
    return state, masked, clipped


def node_unmask(state: NodeState, survivors: list[int], dropped: list[int]) -> tuple[NodeState, dict[int, bytes]]:
    """Stage 4: the seed share of each survivor and the mask-key share of each dropped node it holds
    one of (owner -> share), once: never both shares of one node, which would let the server
    unmask it. The dropped may include nodes it reported (it holds no share of theirs)."""
    _expect(state, STAGES[3])
    me, t, alive, gone = state.node_id, state.setup.threshold, set(survivors), set(dropped)
    if alive & gone:
        raise ValueError(f"secure aggregation: node {me} was asked for both shares of {sorted(alive & gone)}: refusing")
    mine = {me, *state.peers}
    if me not in alive or not alive <= mine or not mine <= alive | gone or not gone <= set(state.public_keys):
        raise ValueError(
            f"secure aggregation: node {me} masked with {sorted(state.peers)}; asked about survivors"
            f" {sorted(alive)} and dropped {sorted(gone)}: refusing"
        )
    check_enough(STAGES[3], len(alive), t)
    reply = {n: state.shares[n][0] for n in alive} | {n: state.shares[n][1] for n in gone if n in state.shares}
    return dataclasses.replace(state, stage=STAGES[3]), reply


def _expect(state: NodeState, stage: str) -> None:
    """Each stage follows the one before, once."""
    before = STAGES[STAGES.index(stage) - 1]
    if state.stage != before:
        raise ValueError(f"secure aggregation: node {state.node_id} asked for '{stage}' after '{state.stage}'")


def _opened(me: int, src: int, key: bytes, ciphertext: bytes, commitments: dict[int, bytes] | None) -> KeyPair | None:
    """The (seed share, mask-key share) `src` encrypted for node `me`, checked to be from and for whom it
    says and (with `commitments`) to be what `src` committed to; None, logged, when it is not."""
    try:
        real_src, dst, seed_share, key_share = share_keys_plaintext_separate(decrypt(key, ciphertext))
    except (InvalidToken, ValueError, IndexError):
        real_src, dst, seed_share, key_share = None, None, b"", b""
    pair = (seed_share, key_share)
    if (real_src, dst) != (src, me) or (
        commitments is not None and commitments.get(src) != checks.commit(src, me, pair)
    ):
        log.warning("secure aggregation: node %s cannot open the shares of node %s: it reports it", me, src)
        return None
    return pair


def _quantize(setup: SecAggSetup, update: np.ndarray, weight: float) -> tuple[np.ndarray, int]:
    """[q(w), clipped, q(w/W · x)] as int64 in [0, 2^bits], and the clipped count. The weight is rounded
    to a multiple of W/2^bits first and the update scaled by the rounded one, so that the weighted sum
    and the weight sum the server divides agree exactly."""
    x = np.asarray(update, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"secure aggregation takes a flat vector; the update has shape {x.shape}")
    if bad := int(np.count_nonzero(~np.isfinite(x))):
        raise ValueError(f"secure aggregation: the update has {bad} non-finite value(s)")
    if not 0 < weight <= setup.max_weight:
        raise ValueError(f"secure aggregation: weight {weight} is outside (0, max-weight {setup.max_weight}]")
    levels = 2**setup.bits
    q_weight = round(weight / setup.max_weight * levels)
    if q_weight == 0:
        raise ValueError(f"secure aggregation: weight {weight} rounds to 0 at {setup.bits} bits of {setup.max_weight}")
    scaled = x * (q_weight / levels)
    clipped = int(np.count_nonzero(np.abs(scaled) > setup.clip))
    values = quantize([scaled], setup.clip, levels)[0]
    return np.concatenate([[q_weight, min(clipped, levels)], values]).astype(np.int64), clipped


def expand_mask(seed: bytes, size: int) -> np.ndarray:
    """A mask of `size` values uniform on the field [0, 2^32), from the seed's full 256 bits."""
    # ChaCha20's keystream keyed by a self-mask seed's 32 bytes (or the 32 bytes a pairwise key's base64
    # holds), read as uint32 words: each exactly uniform. Flower's `pseudo_rand_gen` folds a seed into 32 bits.
    key = seed if len(seed) == 32 else base64.urlsafe_b64decode(seed)
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()  # each key masks one vector
    return np.frombuffer(stream.update(bytes(4 * size)), dtype="<u4").astype(np.int64)


def mask_secret(mask_key: bytes) -> bytes:
    """What a node Shamir-shares of its mask key (PEM): the private scalar, 48 bytes on Flower's
    curve. Shamir works on 16-byte chunks, in pure Python: the PEM text's 306 bytes made 20 of
    them, the scalar makes 4, which cuts a node's share-keys stage and the server's rebuild of a
    dropped node's key about five times."""
    key = asymmetric.bytes_to_private_key(mask_key)
    return key.private_numbers().private_value.to_bytes((key.curve.key_size + 7) // 8, "big")


def mask_key_of(secret: bytes, public_key: bytes) -> bytes:
    """The mask key (PEM) whose scalar is `secret`, rebuilt from shares, if it is the private half
    of `public_key`, the mask key its node published; else ValueError: shares that rebuild some
    other scalar would otherwise remove the wrong masks without a word."""
    public = asymmetric.bytes_to_public_key(public_key)
    key = ec.derive_private_key(int.from_bytes(secret, "big"), public.curve)  # ValueError: out of the curve's range
    if asymmetric.public_key_to_bytes(key.public_key()) != public_key:
        raise ValueError("the rebuilt mask key is not the one the node published")
    return asymmetric.private_key_to_bytes(key)


def agreed_keys(private_key: bytes, public_keys: dict[int, bytes]) -> dict[int, bytes]:
    """Per peer, the key both sides derive alike (ECDH, then HKDF), so no key travels."""
    # From the mask keys: a pairwise mask's seed; from the encryption keys: the key that encrypts shares.
    own = asymmetric.bytes_to_private_key(private_key)
    return {peer: generate_shared_key(own, asymmetric.bytes_to_public_key(key)) for peer, key in public_keys.items()}


def check_known(replies: dict, expected: object, stage: str) -> None:
    """Refuse replies from nodes this stage did not ask, so none can inject a vector or share."""
    if unknown := sorted(set(replies) - set(expected)):
        raise ValueError(f"secure aggregation: replies at '{stage}' from nodes {unknown} that were not asked")


def check_enough(stage: str, remaining: int, threshold: int) -> None:
    """Refuse going on below t nodes: Shamir rebuilds a secret from t shares, not fewer."""
    if remaining < threshold:
        raise BelowThreshold(stage, remaining, threshold)
