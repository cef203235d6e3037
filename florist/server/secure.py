"""The server's side of secure aggregation (`secure-aggregation = "secaggplus"`,
docs/secure-aggregation.md): a training round as four exchanges, each a thin shell around
`florist/common/secagg.py`'s `server_*` function. What comes back is the weighted mean of the
nodes' flat updates, and who took part; never one node's update.

A node whose reply is missing, late or malformed is left out of its stage, as in any exchange; the
round goes on while the threshold remains. Below it, or when the protocol itself refuses (a setup
the round's node count does not allow, shares that do not rebuild a secret), the round stops in one
line and the run stops with its earlier rounds kept, resumable, as a round too few nodes answered."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict

from florist.common import privacy, protocol, secagg, secagg_server
from florist.common import secagg_records as records
from florist.common.spec import Exchange
from florist.server.strategy import NodeInfo, ServerStrategy

# distributed dp: a noise share past this many stds is clipped, 1.2 values in 10^15: over a run of
# 72k values, 4 nodes, 30 rounds about 10^-8, which the reported δ takes on (at 6 stds it was 0.04)
RANGE_STDS = 8.0


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What the server learns from a secure round."""

    mean: np.ndarray  # Σ w·x / Σ w of the survivors' flat vectors (float64)
    clipped: int  # values clipped to [-secagg-clip, secagg-clip], over all survivors
    survivors: list[NodeInfo]
    dropped: list[NodeInfo]  # shared their keys, sent no masked vector or were reported by another
    value_range: float  # c: the setup's range of each value, [-c, c]
    sides: dict[int, dict[str, torch.Tensor]]  # by Flower node id: what each survivor sent in the clear beside
    reported: list[NodeInfo] = dataclasses.field(default_factory=list)  # another could not open their shares
    cheaters: list[NodeInfo] = dataclasses.field(default_factory=list)  # revealed shares they were not sent

    def row(self) -> dict[str, Any]:
        """The round's results fields."""
        return {
            "secagg_survivors": len(self.survivors),
            "secagg_dropped": [n.key for n in self.dropped],
            "secagg_clipped": self.clipped,
            "secagg_reported": [n.key for n in self.reported],
            "secagg_cheaters": [n.key for n in self.cheaters],
        }


def secure_round(
    strategy: ServerStrategy,
    exchanges: tuple[Exchange, Exchange, Exchange, Exchange],
    nodes: list[NodeInfo],
    server_round: int,
    model: ArrayRecord | Callable[[NodeInfo], ArrayRecord],
    size: int,
    max_weight: float,
    dp_sigma: float = 0.0,
    side: Mapping[str, torch.Tensor] | None = None,
    fixed: bool = False,
) -> Outcome:
    """Run the four stages (`exchanges`: setup, share keys, train and mask, unmask) with `nodes`,
    sending `model` to train (one for all, or each node its own: FedAvg's, FedAttn's with the
    node's biases); `size`: the length of the vector each node masks. `dp_sigma`
    (`dp = "distributed"`): the noise multiplier the nodes' noise shares make up; each value's
    range then holds a dp-clipped update plus RANGE_STDS of a node's noise share. `side`: what
    each node also sends in the clear (FedAttn's representation, biases and gradient), as a
    reference of keys, shapes and dtypes; a node whose side does not match drops out of the round.
    `fixed` (under `dp`): every node weighs `max_weight`, and the unmasked weight sum must say so;
    otherwise each weighs at most its train split as it reported at discovery. Unmasked sums no
    honest survivors can make stop the round, nothing aggregated (secagg.check_sums)."""
    cfg = strategy.cfg
    try:
        setup = secagg.SecAggSetup.for_nodes(
            len(nodes),
            cfg.secagg_threshold or None,
            clip=float(cfg.secagg_clip),
            bits=cfg.secagg_bits,
            max_weight=float(max_weight),
        )
        if dp_sigma > 0:
            clip = cfg.user_level().dp_clip  # under record+distributed, dp-user-clip
            share = privacy.share_std(dp_sigma, clip, setup.threshold)
            setup = dataclasses.replace(setup, clip=max(setup.clip, clip + RANGE_STDS * share))
        models = (lambda _: model) if isinstance(model, ArrayRecord) else model
        weights = {n.node_id: (max_weight, max_weight) if fixed else (0.0, min(n.num_train, max_weight)) for n in nodes}
        return _stages(strategy, exchanges, nodes, server_round, models, size, setup, dp_sigma, side, weights)
    except ValueError as err:  # BelowThreshold, a setup this round cannot have, a secret that does not rebuild
        kept = f"rounds 1-{server_round - 1} are" if server_round > 1 else "its start is"
        raise RuntimeError(
            f"round {server_round}: {err}. The run stops; {kept} kept in {cfg.results_dir}: continue it with "
            f"--resume {cfg.results_dir} once enough nodes are back"
        ) from None


def _stages(strategy, exchanges, nodes, server_round, models, size, setup, dp_sigma, side, weights) -> Outcome:
    keys_x, shares_x, train_x, unmask_x = exchanges
    ids = {n.node_id: i for i, n in enumerate(sorted(nodes, key=lambda n: n.node_id), 1)}
    info = {ids[n.node_id]: n for n in nodes}

    def ask(exchange, values: Mapping[int, dict], read: Callable, arrays=None, expect=None) -> dict[int, Any]:
        """Each node (by SecAgg id) its request with `values` (and `arrays(node)`); the replies `read`
        accepts, by SecAgg id."""
        requests = {
            info[i].node_id: records.put(strategy.request(exchange, server_round, arrays and arrays(info[i])), **v)
            for i, v in values.items()
        }
        got = {}
        trips = strategy.exchanger.round_trip(requests, exchange.message_type, server_round, expect)
        for node_id, content in trips.items():
            try:
                got[ids[node_id]] = read(ids[node_id], content, strategy.exchanger.name(node_id))
            except protocol.ProtocolError as err:
                strategy.exchanger.fail(node_id, exchange.message_type, server_round, str(err))
        return got

    public = ask(keys_x, {i: records.setup_values(i, setup) for i in info}, _own_keys)
    state, public = secagg_server.server_keys(setup, public)
    sent = ask(shares_x, dict.fromkeys(public, records.keys_values(public)), _shares_for(set(public)))
    state, routed = secagg_server.server_route_shares(state, sent)
    reference = {records.MASKED: torch.zeros(size + secagg.HEADER, dtype=torch.uint32)}
    trained = ask(
        train_x,
        {i: records.routed_values(c) | {"dp-sigma": float(dp_sigma)} for i, c in routed.items()},
        lambda _, content, source: _masked(content, source, reference, side),
        arrays=models,
        expect={records.SECAGG: reference} | ({protocol.SIDE: side} if side else {}),
    )
    reports = {i: r for i, (_, _, r) in trained.items()}
    state, (survivors, dropped) = secagg_server.server_collect_masked(
        state, {i: v for i, (v, _, _) in trained.items()}, reports
    )
    unmask = records.unmask_values(survivors, dropped)
    shares = ask(unmask_x, dict.fromkeys(survivors, unmask), lambda _, content, source: records.by_id(content, source))
    result = secagg_server.server_aggregate(state, shares, {i: weights[n.node_id] for i, n in info.items()})
    fail = strategy.exchanger.fail
    for i in sorted(set().union(*map(set, reports.values())) & set(state.sharers)):
        by = ", ".join(info[r].key for r, them in sorted(reports.items()) if i in them)
        fail(info[i].node_id, shares_x.message_type, server_round, f"its shares could not be opened by {by}: dropped")
    for i in result.cheaters:
        why = "revealed shares unlike their owners' commitments: left out of this and every later round"
        fail(info[i].node_id, unmask_x.message_type, server_round, why)
    return Outcome(
        result.mean,
        result.clipped,
        [info[i] for i in result.survivors],
        [info[i] for i in result.dropped],
        setup.clip,
        {info[i].node_id: trained[i][1] for i in result.survivors},
        [info[i] for i in sorted(set().union(*map(set, reports.values())) & set(state.sharers))],
        [info[i] for i in result.cheaters],
    )


def _own_keys(node: int, content: RecordDict, source: str) -> secagg.KeyPair:
    """A setup reply: one key pair, under the node's own SecAgg id."""
    keys = records.keys_of(content, source)
    if list(keys) != [node]:
        raise protocol.ProtocolError(f"{source}: sent keys for SecAgg ids {list(keys)[:3]}, not its own, {node}")
    return keys[node]


def _shares_for(public: set[int]) -> Callable[[int, RecordDict, str], tuple[dict[int, bytes], dict[int, bytes]]]:
    def read(node: int, content: RecordDict, source: str) -> tuple[dict[int, bytes], dict[int, bytes]]:
        """A share-keys reply: one ciphertext for each other node that sent keys, and a commitment
        to the shares of each node, its own included."""
        sent, commitments = records.by_id(content, source), records.commitments_of(content, source)
        if set(sent) != public - {node} or set(commitments) != public:
            raise protocol.ProtocolError(
                f"{source}: sent shares for {len(sent)} nodes, not the {len(public) - 1} others, or"
                f" commitments for {len(commitments)}, not {len(public)}"
            )
        return sent, commitments

    return read


def _masked(
    content: RecordDict, source: str, reference: Mapping[str, torch.Tensor], side: Mapping[str, torch.Tensor] | None
) -> tuple[np.ndarray, dict[str, torch.Tensor], list[int]]:
    """A train-and-mask reply's masked vector (one uint32 array of the expected length), what it
    sent in the clear beside it, as `side` says (nothing when `side` is None), and the nodes it
    reported (whose shares it could not open)."""
    vector = protocol.arrays_of(content, reference, source, key=records.SECAGG)[records.MASKED].numpy()
    sides = protocol.arrays_of(content, side, source, key=protocol.SIDE) if side else {}
    return vector, sides, records.reported_of(content, source)
