"""The run a ServerApp makes (`florist/apps/server.py`): discover the nodes, run the strategy's
server half round by round, evaluate seen and unseen clients, and write results (checkpointed
after every round)."""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from flwr.serverapp import Grid

from florist.common import protocol
from florist.common.metrics import weighted_mean
from florist.common.privacy import RECORD_RELATION, UNSEEDED
from florist.common.spec import INFO
from florist.config import RunConfig
from florist.server.checkpoint import Checkpoint
from florist.server.exchange import Exchanger
from florist.server.report import number, plural, summary_text
from florist.server.results import Results
from florist.server.strategy import NodeInfo, ServerStrategy
from florist.server.tracking import Tracking

# A child of Flower's logger, so messages reach `flwr run --stream` and the SuperLink log.
log = logging.getLogger("flwr").getChild(__name__)

RoundCallback = Callable[[dict[str, Any]], None]


def discover(
    exchanger: Exchanger,
    cfg: RunConfig,
    node_ids: list[int],
    taken: dict[str, str] | None = None,
    bound: dict[str, int] | None = None,
) -> list[NodeInfo]:
    """Ask nodes who they are (one `query.info` exchange). A node is recorded as failed and left
    out, never raising here, when its answer is ill-formed, when its key is `bound` to another
    SuperNode or `taken` (key -> why a node claiming it now is refused: the serve phase's keys in
    use), when another node claims its key in the same discovery and the key is bound to
    neither (both are left out: answering first wins nothing, and `taken` gains the key), or
    when it is to train and holds no training example. `bound` (key -> Flower node id, with
    `bind-node-keys`) is read only: the caller binds the nodes it keeps (`bind`), once it has
    also checked their input shapes, so a node left out for its shape binds nothing."""
    request = protocol.content(config=protocol.message_config(cfg, INFO, 0, exchanger.run_id))
    replies = exchanger.round_trip({n: request for n in node_ids}, INFO.message_type, 0)
    claims: dict[str, list[NodeInfo]] = {}  # one lookup per reply: a federation of thousands stays linear
    for node_id, reply in replies.items():
        try:
            key, shape, metrics = protocol.info_of(reply, f"node {node_id}")
            said = protocol.data_of(reply, f"node {node_id}")
        except protocol.ProtocolError as err:
            exchanger.fail(node_id, INFO.message_type, 0, f"ill-formed info reply: {err}")
            continue
        node = NodeInfo(
            node_id, key, bool(metrics["seen"]), int(metrics["num-train"]), int(metrics["num-test"]), shape, said
        )
        claims.setdefault(key, []).append(node)
    nodes = []
    for key, claimants in claims.items():
        node = _settle(exchanger, key, claimants, {} if taken is None else taken, bound)
        if node is None:
            continue
        if node.seen and node.num_train < 1:
            exchanger.fail(node.node_id, INFO.message_type, 0, "it holds no training example, and seen nodes train")
            continue
        nodes.append(node)
    exchanger.names.update({n.node_id: str(n) for n in nodes})
    return sorted(nodes, key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n.key)])


def bind(bound: dict[str, int] | None, nodes: list[NodeInfo]) -> None:
    """With `bind-node-keys` (`bound` not None): each kept node's key is its SuperNode's from now on."""
    if bound is not None:
        bound.update({n.key: n.node_id for n in nodes})


def _settle(
    exchanger: Exchanger, key: str, claimants: list[NodeInfo], taken: dict[str, str], bound: dict[str, int] | None
) -> NodeInfo | None:
    """Who of `claimants` (the nodes that name `key` in one discovery) gets the key: none when
    it is `taken`, else the SuperNode it is bound to, else its only claimant; every other
    claimant is recorded as failed with a reason that names who holds or disputes the key."""
    owner = bound.get(key) if bound is not None else None
    if key in taken:
        winner, reason = None, taken[key]
    elif owner is not None:
        winner, reason = next((n for n in claimants if n.node_id == owner), None), f"bound to SuperNode {owner}"
    elif len(claimants) > 1:
        winner, reason = None, disputed([n.node_id for n in claimants])
        taken[key] = reason
    else:
        return claimants[0]
    for node in claimants:
        if node is not winner:
            exchanger.fail(node.node_id, INFO.message_type, 0, f"node key {key!r} is {reason}")
    return winner


def disputed(node_ids: list[int]) -> str:
    """Why a key that `node_ids` all claim, and that is bound to none of them, goes to none."""
    ids = [str(i) for i in sorted(node_ids)]
    named = f"{', '.join(ids[:-1])} and {ids[-1]}" if len(ids) <= 4 else f"{', '.join(ids[:3])} and {len(ids) - 3} more"
    return f"claimed by nodes {named} at once; a key bound to none of its claimers goes to none"


def run(
    grid: Grid,
    cfg: RunConfig,
    half: type[ServerStrategy],
    on_round: RoundCallback | None = None,
    run_id: int = 0,
) -> Results:
    """The whole run of the server half `half` (from its checkpoint on, with `resume-from`);
    returns the results it also wrote to `cfg.results_dir`. `run_id`: Flower's id of this run."""
    resumed = Checkpoint.load(cfg.resume_from) if cfg.resume_from else None
    exchanger = Exchanger(grid, cfg.round_timeout, resumed.run_id if resumed else run_id, cfg.max_reply_mb)
    results = Results(cfg, half.report, exchanger.run_id)
    if not resumed:
        results.save()  # a run stopped before its first round still says so
    # With `bind-node-keys`, a key belongs to the SuperNode (under SuperNode auth: the public key)
    # that first claimed it alone, for the whole run, resumed parts included.
    bound = (dict(resumed.bindings) if resumed else {}) if cfg.bind_node_keys else None
    for warning in cfg.settings.warnings(cfg.num_server_rounds):  # `florist` commands said it before the run
        log.warning(warning)
    nodes = start_nodes(exchanger, cfg, bound, resuming=resumed is not None)
    seen, unseen = [n for n in nodes if n.seen], [n for n in nodes if not n.seen]
    strategy = half(cfg, exchanger, nodes[0].input_shape, len(seen))
    exchanger.take_bytes()
    exchanger.take_exchanges()
    done = 0
    if resumed:
        resumed.check(cfg, [n.key for n in nodes])
        strategy.load_state(resumed.state)
        done, results.rounds = resumed.round, resumed.rounds
        exchanger.failures = resumed.failures + exchanger.failures  # ... and this discovery's
        log.info("resuming the run of %s after round %d", cfg.resume_from, done)
    keys = [n.key for n in nodes]
    with Tracking.start(cfg) as tracking:  # what the run's trackers get: rounds once checkpointed
        tracking.log_rounds(results.rounds, exchanger.failures)  # a resumed run's, where a tracker missed some
        for server_round in rounds_to_train(strategy, results, done + 1):
            row = train_round(strategy, results, seen, server_round)
            state = Checkpoint(
                server_round,
                cfg.to_mapping(),
                exchanger.run_id,
                keys,
                strategy.state(),
                exchanger.failures,
                results.rounds,
                bound or {},
            )
            results.checkpoint(state)
            tracking.log_rounds(results.rounds, exchanger.failures)
            (on_round or _log_round)(row)

        final_round = cfg.num_server_rounds + 1
        scores = strategy.evaluate(final_round, seen) | strategy.serve(final_round, unseen)
        check_replies(cfg, exchanger, exchanger.take_exchanges(), final_round)
        late = serve_late_joiners(exchanger, strategy, cfg, nodes, scores, bound)
        results.set_clients(nodes + late, scores, record_named(strategy, seen))
        results.failures = exchanger.failures
        results.write()
        tracking.finish(results.to_json(), results.folder)
    _log_summary(results)
    return results


def _log_summary(results: Results) -> None:
    """The table `florist` commands print at the end, one log record a line (each gets Flower's
    prefix), so `flwr run --stream` and the SuperLink log end with it too, then the folder."""
    for line in summary_text(results.to_json()):
        log.info("%s", line)
    log.info("results in %s", results.folder.resolve())


def start_nodes(
    exchanger: Exchanger, cfg: RunConfig, bound: dict[str, int] | None = None, resuming: bool = False
) -> list[NodeInfo]:
    """The nodes of the run, once `min-nodes` are connected and have said who they are: those
    with the input shape most of them have (the others are left out, named); refuses a run in
    which fewer of them are usable than `min-train-nodes` (or than were asked, when fewer were),
    as `check_replies` refuses such a round, or with none to train. `bound`: as `discover`'s.
    A `resuming` run is left to its checkpoint's check, which names the nodes that are missing."""
    asked = exchanger.wait_for_nodes(cfg.min_nodes, cfg.node_wait_timeout)
    nodes = discover(exchanger, cfg, asked, bound=bound)
    if nodes:
        shapes = [n.input_shape for n in nodes]
        shape = max(shapes, key=shapes.count)  # the most common; on a tie, the first node's in key order
        for node in (n for n in nodes if n.input_shape != shape):
            exchanger.fail(
                node.node_id, INFO.message_type, 0, f"input shape {node.input_shape}, most nodes' is {shape}"
            )
        nodes = [n for n in nodes if n.input_shape == shape]
    bind(bound, nodes)
    if not nodes or (not resuming and len(nodes) < min(cfg.min_train_nodes, len(asked))):
        first = exchanger.failures[0] if exchanger.failures else {"node": "-", "reason": "-"}
        raise RuntimeError(
            f"{f'only {len(nodes)} of {len(asked)} nodes' if nodes else 'no node'} answered the info request "
            f"usably (min-train-nodes {cfg.min_train_nodes}; {len(exchanger.failures)} failed, the first, "
            f"{first['node']}: {first['reason']})"
        )
    seen = [n for n in nodes if n.seen]
    log.info(
        "%s: %d seen (train), %d unseen (serve only)", plural(len(nodes), "node"), len(seen), len(nodes) - len(seen)
    )
    if not seen:
        raise RuntimeError("no seen node to train with: every node is held out as unseen")
    return nodes


def rounds_to_train(strategy: ServerStrategy, results: Results, first: int) -> Iterator[int]:
    """The rounds from `first` to num-server-rounds, until the strategy stops training before one
    (a privacy budget it would exceed): said in one warning and in results.json's `stopped`; the
    run then evaluates and ends as usual."""
    for server_round in range(first, strategy.cfg.num_server_rounds + 1):
        if stop := strategy.stop_before(server_round):
            log.warning("%s", stop)
            results.stopped = stop
            return
        yield server_round


def train_round(strategy: ServerStrategy, results: Results, seen: list[NodeInfo], server_round: int) -> dict[str, Any]:
    """One round: train a sample of the seen nodes, evaluate them when it is an evaluation
    round, and add the round's row (loss, accuracy, bytes, seconds, exchanges) to `results`."""
    cfg, exchanger, start = strategy.cfg, strategy.exchanger, time.monotonic()
    loss = strategy.train_round(server_round, strategy.sample(seen, server_round))
    accuracy, evaluated = None, {}
    if cfg.eval_every and server_round % cfg.eval_every == 0:
        scores = strategy.evaluate(server_round, seen)
        accuracy = _mean_accuracy(scores)
        # The global model's accuracy where clients report it beside their own (kNN-Per, FedAvg+finetune).
        if scores and all("global-accuracy" in m for m in scores.values()):
            evaluated = {"global_accuracy": _mean_accuracy(scores, "global-accuracy")}
    up, down = exchanger.take_bytes()
    exchanges = exchanger.take_exchanges()
    check_replies(cfg, exchanger, exchanges, server_round)
    extras = strategy.round_extras() | evaluated | record_fields(strategy, seen, exchanger.take_record())
    extras |= {"exchanges": exchanges}
    return results.add_round(server_round, time.monotonic() - start, up, down, loss, accuracy, extras)


def record_fields(
    strategy: ServerStrategy, seen: list[NodeInfo], said: Mapping[int, Mapping[str, Any]]
) -> dict[str, Any]:
    """Under record-level dp, a round's row: the largest ε a node that took DP-SGD steps in it says it has
    spent (each node's own ledger: florist/client/ledger.py) and, unless the round's sample is private, each
    such node's ε, σ, q and steps by its key. Nothing without record-level dp."""
    if not strategy.cfg.record_dp:
        return {}
    spent = [s["epsilon"] for s in said.values() if "epsilon" in s]
    row: dict[str, Any] = {"dp_record_epsilon": max(spent) if spent else None, "dp_record_relation": RECORD_RELATION}
    if any("guarantee" in s for s in said.values()):
        row["dp_record_guarantee"] = UNSEEDED
    if not strategy.samples_privately(len(seen)):  # who trained is the round's to tell
        keys = {n.node_id: n.key for n in seen}
        fields = ("epsilon", "sigma", "q", "steps", "accountant")
        named = {keys.get(node, strategy.exchanger.name(node)): s for node, s in said.items()}
        row["dp_record_nodes"] = {key: {f: named[key][f] for f in fields if f in named[key]} for key in sorted(named)}
    return row


def record_named(strategy: ServerStrategy, seen: list[NodeInfo]) -> Mapping[int, Mapping[str, Any]] | None:
    """Under record-level dp, what each node last said of its ε, for the clients' rows; None without it, or
    under a private sample (a node's steps would tell how often it trained)."""
    named = strategy.cfg.record_dp and not strategy.samples_privately(len(seen))
    return strategy.exchanger.record_latest if named else None


def check_replies(cfg: RunConfig, exchanger: Exchanger, exchanges: list[dict[str, Any]], server_round: int) -> None:
    """A round in which an exchange got fewer replies than `min-train-nodes` (or than the nodes
    it asked, when fewer were asked) did not happen: raise, naming the exchange, the first
    reason a node gave and how to go on, before the round is checkpointed, so the run keeps the
    rounds before it and is never written complete."""
    for e in exchanges:
        if e["replies"] < min(cfg.min_train_nodes, e["nodes"]):
            failed = [f for f in exchanger.failures if f["round"] == server_round]
            reason = f"; first failure, {failed[0]['node']}: {failed[0]['reason']}" if failed else ""
            final = server_round > cfg.num_server_rounds
            kept = f"rounds 1-{server_round - 1} are" if server_round > 1 else "its start is"
            raise RuntimeError(
                f"{'the final evaluation' if final else f'round {server_round}'}: {e['replies']} of {e['nodes']} "
                f"nodes answered {e['type']} (min-train-nodes {cfg.min_train_nodes}){reason}. The run stops; "
                f"{kept} kept in {cfg.results_dir}: continue it with --resume {cfg.results_dir} once the nodes are back"
            )


def serve_late_joiners(
    exchanger: Exchanger,
    strategy: ServerStrategy,
    cfg: RunConfig,
    nodes: list[NodeInfo],
    scores: dict[int, dict[str, float]],
    bound: dict[str, int] | None = None,
) -> list[NodeInfo]:
    """The serve phase for nodes that connect after training (deployment): each gets its
    personalized model from `strategy.serve`, until `serve-seconds` have passed or
    `serve-count` nodes were served. Their scores are added to `scores`. A late node cannot
    take a key of the run's nodes, and a key that two late nodes claim, at once or one after
    the other, goes to neither unless it is bound: the one served first is struck out again."""
    if cfg.serve_seconds <= 0:
        return []
    log.info("serving nodes that join in the next %.0f s", cfg.serve_seconds)
    deadline, served = time.monotonic() + cfg.serve_seconds, []
    known, taken = {n.node_id for n in nodes}, {n.key: f"already {n}'s" for n in nodes}
    late: dict[str, NodeInfo] = {}  # key -> the late node served with it

    def strike(earlier: NodeInfo) -> None:  # a late node served with a key disputed since loses it
        late.pop(earlier.key)
        exchanger.fail(earlier.node_id, INFO.message_type, 0, f"node key {earlier.key!r} is {taken[earlier.key]}")
        served.remove(earlier)
        scores.pop(earlier.node_id, None)

    while time.monotonic() < deadline and not (cfg.serve_count and len(served) >= cfg.serve_count):
        new = sorted(set(exchanger.grid.get_node_ids()) - known)
        if not new:
            time.sleep(1.0)
            continue
        known.update(new)
        joined = []
        for node in discover(exchanger, cfg, new, taken, bound):
            if node.input_shape != strategy.input_shape:
                exchanger.fail(
                    node.node_id,
                    INFO.message_type,
                    0,
                    f"input shape {node.input_shape}, expected {strategy.input_shape}",
                )
            elif (earlier := late.get(node.key)) is not None:  # unbound: `discover` refuses a bound key
                taken[node.key] = disputed([earlier.node_id, node.node_id])
                strike(earlier)
                exchanger.fail(node.node_id, INFO.message_type, 0, f"node key {node.key!r} is {taken[node.key]}")
            else:
                joined.append(dataclasses.replace(node, seen=False))  # joined after training: unseen by definition
        for earlier in [n for key, n in late.items() if key in taken]:  # two newcomers disputed its key at once
            strike(earlier)
        bind(bound, joined)
        log.info("serving %s", ", ".join(str(n) for n in joined) or "nobody (no valid node)")
        scores.update(strategy.serve(cfg.num_server_rounds + 1, joined))
        served += joined
        late |= {n.key: n for n in joined}
    return served


def _mean_accuracy(metrics: Mapping[int, Mapping[str, float]], key: str = "accuracy") -> float | None:
    if not metrics:
        return None
    return weighted_mean([m[key] for m in metrics.values()], [m["num-examples"] for m in metrics.values()])


def _log_round(row: dict[str, Any]) -> None:
    log.info(
        "round %d done in %.1f s: train loss %s, seen accuracy %s%s%s",
        row["round"],
        row["seconds"],
        number(row["train_loss"], ".4f"),
        number(row["accuracy"], ".1%"),
        f", ε spent {row['dp_epsilon']:.3g}" if row.get("dp_epsilon") is not None else "",
        f", record-level ε ≤ {eps:.3g} per node" if (eps := row.get("dp_record_epsilon")) is not None else "",
    )
