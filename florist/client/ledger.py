"""A node's privacy ledger (docs/privacy.md, "The node's own ledger"): every noised release the
node makes under `dp = "local"` or `"distributed"`, and every DP-SGD step it takes under
`dp = "record"` (`RecordLedger`), kept in its own state folder, so that what a server sends
cannot spend the node's budget for it.

- A release is keyed by the run and the round: under the node's own dp, Flower's run id (the
  node's context: a new run is a new one, whatever `run-id` the server's config says). The same
  (run, round) asked again gets the noised reply the node stored, never a fresh draw: averaging
  fresh draws would strip the noise.
- Under the node's own dp (its `--node-config` sets `dp`), the budget is the node's lifetime's:
  σ comes from its dp-epsilon over `dp-releases` releases (or its dp-noise-multiplier), never
  from the server's num-server-rounds, and the node refuses, in one line, the release that would
  take it past its dp-epsilon, in whichever run. Without a dp of its own a node follows its
  server's settings, and the ledger counts the releases of that run only.
- An account keeps at most KEPT_SIGMAS noise levels however often a server changes σ (`merge`).
- Under its own dp the node answers only the message types its mechanism bounds
  (`refuse_unbounded`).

What it cannot stop: a wiped state folder, or the same data behind a second install (another
`state-dir` or node key), starts a fresh budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Collection, Iterator, Mapping

import numpy as np

from florist.client.guard import Refused
from florist.client.node import Node
from florist.client.state import NodeState
from florist.common import privacy, record_dp
from florist.common.settings import coerce

log = logging.getLogger("flwr").getChild(__name__)

RELEASES = "dp-releases"  # node-config key: the noised releases its lifetime budget is sized for
DEFAULT_RELEASES = 30  # as num-server-rounds' default: one run's worth
BOOK = "ledger.json"
KEPT_REPLIES = 8  # stored noised replies (the newest); an older repeat is refused, never drawn again
KEPT_KEYS = 4096  # (run, round) keys kept for repeats; what is spent is kept whole, as counts per σ
KEPT_RUNS = 16  # the accounts of runs under their server's dp (the node's own is never dropped)
KEPT_SIGMAS = 16  # distinct σ per account; past them the two nearest merge at the smaller (more ε, never less)
DP_STRATEGIES = ("fedavg", "fedavg-ft", "knnper")  # whose every model message local and distributed dp noise
# record-level dp's own book, beside BOOK under the same lock (a florist that predates it rewrites BOOK whole)
RECORD_BOOK = "record-ledger.json"
STEPS = "record-steps"  # the book's DP-SGD steps: {account: {"q σ": steps}}
ROUNDS = "record-rounds"  # ... and the messages that took them: {account: count}
SIGMAS = "record-sigmas"  # σ calibrated for (ε, δ, q, steps): a forked process need not search again
KEPT_CALIBRATIONS = 64  # the newest σ calibrations kept in the book


def owns_privacy(node_config: Mapping) -> bool:
    """Whether the node's own `--node-config` sets its dp (a promise the node keeps itself)."""
    return str(node_config.get("dp", "none")) != "none"


def own_plan(node: Node) -> privacy.Plan:
    """The plan the node draws its noise with: under its own dp, σ for its dp-epsilon over its
    `dp-releases` (q = 1: its own data, every release), or its dp-noise-multiplier; else the
    run's, as its server sized it."""
    cfg = node.cfg
    if not owns_privacy(node.node_config):
        return privacy.Plan.of(cfg)
    return privacy.Plan.of(dataclasses.replace(cfg, num_server_rounds=own_releases(node)))


def refuse_unbounded(
    node: Node, message_type: str, bounded: Collection[str], record_bounded: Collection[str] = ()
) -> None:
    """Under the node's own dp, refuse a message type (or a strategy) whose reply its mechanism
    does not bound: `bounded` are the types whose data-dependent values it noises and counts,
    or that carry none (docs/privacy.md lists each); under record-level dp (the node's own or its
    server's), `record_bounded` are those whose every such value is DP-SGD's output or a step of it, of a
    strategy whose spec says record-level dp covers it (`StrategySpec.record_covered`, `RunConfig.record_refusal`)."""
    if node.cfg.record_dp and (message_type not in record_bounded or node.cfg.record_refusal()):
        raise Refused(
            f"node {node.key}: record-level dp = {node.cfg.dp!r} does not bound a {message_type!r} reply of strategy "
            f"{node.cfg.strategy!r}: refused"
        )
    if not owns_privacy(node.node_config) or node.cfg.user_dp == "none":
        return
    if message_type not in bounded or node.cfg.strategy not in DP_STRATEGIES:
        raise Refused(
            f"node {node.key}: its own dp = {node.cfg.dp!r} does not bound a {message_type!r} reply of strategy "
            f"{node.cfg.strategy!r}: refused"
        )


def epsilon(spent: Mapping[float, int], delta: float) -> float:
    """ε of the releases `spent` (how many at each noise multiplier σ) at q = 1, by the tighter of
    the accountants, as σ was calibrated (a looser count would refuse releases the plan promised)."""
    return privacy.tightest(tuple((1.0, sigma) for sigma, count in sorted(spent.items()) for _ in range(count)), delta)[
        0
    ]


def merge(counts: dict[str, int], who: str) -> None:
    """Keep at most KEPT_SIGMAS σ in `counts` ({repr(σ): releases}), whatever σ a server sends
    each release (under distributed dp any σ at least the node's, and with no finite dp-epsilon
    no cap ends the releases): the releases at the larger of the two nearest σ are counted at the
    smaller, which only overstates ε (a Gaussian release spends less the larger its σ)."""
    while len(counts) > KEPT_SIGMAS:
        sigmas = sorted(counts, key=float)
        low, high = min(zip(sigmas, sigmas[1:]), key=lambda pair: float(pair[1]) / float(pair[0]))
        counts[low] += counts.pop(high)
        log.info("node %s: dp: over %d noise levels in its ledger: σ = %s counted at %s", who, KEPT_SIGMAS, high, low)


class Ledger:
    """The releases of one node, this message's (run, round) among them: `prior` before the work,
    `release` to draw the noise once."""

    def __init__(self, node: Node):
        self.node, self.plan = node, own_plan(node)
        self.own = owns_privacy(node.node_config)
        # the run: Flower's under its own dp; else the run-id its trusted server keeps across a resume
        self.run = node.flower_run_id if self.own else node.run_id
        self.key = [self.run, node.server_round]
        self.files = NodeState(node.state.folder.parent, node.key, "privacy")  # beside every strategy's folder

    def prior(self) -> dict[str, np.ndarray] | None:
        """This (run, round)'s stored noised reply, or None when the node may make it (refused
        in one line when another release would pass its dp-epsilon): asked before the work."""
        book = self._book()
        return self._stored(book) if self.key in book["keys"] else self._check(book)

    def release(self, draw: Callable[[privacy.Plan], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """`draw(plan)`'s noised arrays, counted and stored before they leave; the stored ones
        when this (run, round) was released already."""
        with self._locked():
            book = self._book()
            if self.key in book["keys"]:
                return self._stored(book)
            self._check(book)
            arrays = draw(self.plan)
            self.files.save_arrays(self._reply_name(self.key), arrays)
            self._count(book)
            self.files.save_json(BOOK, book)
            self._prune(book)
        log.info(
            "node %s: dp release (run %s, round %s): ε = %.3g of dp-epsilon %g spent%s",
            self.node.key,
            *self.key,
            self._spent(book),
            self.plan.cap,
            " in this node's lifetime" if self.own else " in this run",
        )
        return arrays

    # --- the book ------------------------------------------------------------------------
    def _book(self) -> dict:
        """{"spent": {account: {σ: count}}, "keys": [[run, round], ...] (the newest)}: the account is "own"
        (the node's lifetime, under its own dp) or "run-<id>" (its server's settings, per run)."""
        book = self.files.load_json(BOOK) or {}
        return {"spent": book.get("spent", {}), "keys": book.get("keys", [])}

    @property
    def _account(self) -> str:
        """Whose budget a release spends: the node's lifetime's, or (the server's dp) the run's."""
        return "own" if self.own else f"run-{self.run}"

    def _spent(self, book: dict, more: int = 0) -> float:
        counts = {float(s): n for s, n in book["spent"].get(self._account, {}).items()}
        if more:
            counts[self.plan.sigma] = counts.get(self.plan.sigma, 0) + more
        return epsilon(counts, self.plan.delta)

    def _check(self, book: dict) -> None:
        after = self._spent(book, 1)
        if math.isfinite(self.plan.cap) and after > self.plan.cap * (1 + 1e-9):
            where = "its lifetime" if self.own else f"run {self.run}"
            releases = sum(book["spent"].get(self._account, {}).values())
            raise Refused(
                f"node {self.node.key}: dp: another noised release would spend ε = {after:.3g} > its dp-epsilon "
                f"{self.plan.cap:g} ({releases} releases in {where}, σ = {self.plan.sigma:.4g}); it releases no more"
            )

    def _count(self, book: dict) -> None:
        counts = book["spent"].setdefault(self._account, {})
        counts[repr(self.plan.sigma)] = counts.get(repr(self.plan.sigma), 0) + 1
        merge(counts, self.node.key)
        book["keys"] = [*book["keys"], self.key][-KEPT_KEYS:]
        runs = [account for account in book["spent"] if account != "own"]
        for account in runs[:-KEPT_RUNS]:
            del book["spent"][account]

    def _stored(self, book: dict) -> dict[str, np.ndarray]:
        arrays = self.files.load_arrays(self._reply_name(self.key))
        if arrays is None:
            raise Refused(
                f"node {self.node.key}: dp: round {self.node.server_round} of this run was released already and its "
                "noised reply is no longer kept; a fresh draw would spend its budget again: refusing"
            )
        log.info(
            "node %s: round %s asked again: the stored noised reply goes, nothing spent", self.node.key, self.key[1]
        )
        return arrays

    def _reply_name(self, key: list[int]) -> str:
        return f"reply-{key[0]}-{key[1]}.npz"

    def _prune(self, book: dict) -> None:
        """Keep the newest KEPT_REPLIES stored replies (their keys stay: an older repeat is refused)."""
        kept = {self._reply_name(key) for key in book["keys"][-KEPT_REPLIES:]}
        for path in self.files.path(BOOK).parent.glob("reply-*.npz"):
            if path.name not in kept:
                path.unlink(missing_ok=True)

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        """The book to this process alone (a node may answer two messages at once)."""
        return _locked(self.files)


def own_releases(node: Node) -> int:
    """`dp-releases` of the node's --node-config: the rounds its own budget is sized for."""
    releases = coerce(RELEASES, node.node_config.get(RELEASES, DEFAULT_RELEASES), int)
    if releases < 1:
        raise ValueError(f"node-config key {RELEASES!r} must be an integer >= 1, got {releases}")
    return releases


class RecordLedger:
    """The DP-SGD steps of one node under `dp = "record"` (docs/privacy.md, "Record-level dp"), kept
    beside the book of its noised releases (`RECORD_BOOK`): `reserve` counts a message's steps before any is taken,
    at the node's rate q = batch-size / n and its σ, and takes fewer when all of them would pass its
    dp-epsilon (none: the round is refused in one line). ε is composed over every step of every round
    the account holds (RDP and PLD, the smaller reported), never over what a server says.

    The account: under the node's own dp (its --node-config sets `dp`), its lifetime's, over every run
    (keyed by Flower's run id), σ spending its dp-epsilon over `dp-releases` rounds of this message's
    steps; else its server's run's (the run-id it keeps across a resume), σ over num-server-rounds."""

    def __init__(self, node: Node):
        cfg = node.cfg
        self.node, self.own = node, owns_privacy(node.node_config)
        self.run = node.flower_run_id if self.own else node.run_id
        self.account = "own" if self.own else f"run-{self.run}"
        self.files = NodeState(node.state.folder.parent, node.key, "privacy")
        self.cap, self.delta, self.clip = cfg.dp_epsilon, cfg.dp_delta, cfg.dp_clip
        self.given, self.batch_size = cfg.dp_noise_multiplier, cfg.batch_size
        self.rounds = own_releases(node) if self.own else max(1, cfg.num_server_rounds)
        self.seeded = cfg.dp_noise_seed > 0
        self.q = self.sigma = self.epsilon = 0.0
        self.accountant = ""
        self.available = self.reserved = 0  # steps reserved in this message: not yet taken, and in all

    def rate(self, n: int) -> float:
        """q = batch-size / n: each record's chance to be in a step's Poisson sample."""
        return min(1.0, self.batch_size / max(1, n))

    def reserve(self, count: int, n: int, per_round: int | None = None) -> int:
        """Count up to `count` more steps on a train split of `n` records in the book, before any is
        taken: all of them, or as many as keep ε within dp-epsilon (the node says so); a Refused, in
        one line, when not even one does. `per_round`: the steps a round of this kind takes (σ spends
        dp-epsilon over that many a round; default `count`)."""
        q = self.rate(n)
        with _locked(self.files):
            book = self.files.load_json(RECORD_BOOK) or {}
            sigma = self._sigma(book, q, per_round or count)
            held = book.get(STEPS, {}).get(self.account, {})
            done = {tuple(map(float, key.split())): steps for key, steps in held.items()}

            def after(k: int) -> record_dp.Steps:
                counts = dict(done)
                counts[(q, sigma)] = counts.get((q, sigma), 0) + k
                return tuple((q_, s, c) for (q_, s), c in sorted(counts.items()))

            within = lambda k: record_dp.steps_tightest(after(k), self.delta)[0] <= self.cap * (1 + 1e-9)  # noqa: E731
            allowed = count if not math.isfinite(self.cap) else most(count, within)
            if allowed > 0:
                steps = book.setdefault(STEPS, {}).setdefault(self.account, {})
                steps[f"{q!r} {sigma!r}"] = steps.get(f"{q!r} {sigma!r}", 0) + allowed
                rounds = book.setdefault(ROUNDS, {})
                rounds[self.account] = rounds.get(self.account, 0) + 1
                accounts = [a for a in book[STEPS] if a != "own"]
                for account in accounts[:-KEPT_RUNS]:
                    del book[STEPS][account]
                    book[ROUNDS].pop(account, None)
            self.files.save_json(RECORD_BOOK, book)  # the count, or only the calibration, before any step is taken
        if allowed == 0:
            eps = record_dp.steps_tightest(after(1), self.delta)[0]
            where = "its lifetime" if self.own else f"run {self.run}"
            raise Refused(
                f"node {self.node.key}: dp = record: another DP-SGD step would spend ε = {eps:.3g} > its dp-epsilon "
                f"{self.cap:g} ({sum(done.values())} steps in {where}, q = {q:.3g}, σ = {sigma:.4g}); it trains no more"
            )
        self.q, self.sigma = q, sigma
        self.epsilon, self.accountant = record_dp.steps_tightest(after(allowed), self.delta)
        self.available, self.reserved = self.available + allowed, self.reserved + allowed
        self._say(allowed, count)
        return allowed

    def _say(self, allowed: int, count: int) -> None:
        """The node's log line of a reservation (a warning first when it takes fewer steps than asked)."""
        if allowed < count:
            log.warning(
                "node %s: dp = record: %d of %d steps this round; one more would pass its dp-epsilon %g",
                self.node.key,
                allowed,
                count,
                self.cap,
            )
        log.info(
            "node %s: dp = record, round %s: %d DP-SGD steps at q = %.3g, σ = %.4g: ε = %.3g of dp-epsilon %g spent%s",
            self.node.key,
            self.node.server_round,
            allowed,
            self.q,
            self.sigma,
            self.epsilon,
            self.cap,
            " in this node's lifetime" if self.own else " in this run",
        )

    def take(self, count: int) -> int:
        """Take `count` of the reserved steps (as many as are left)."""
        taken = min(count, self.available)
        self.available -= taken
        return taken

    def report(self) -> dict[str, float | int | str]:
        """What the node tells its server beside the reply (`dp-record`): ε spent so far (none with a seeded
        noise, which promises nothing), its accountant, σ, q, δ, C and the steps this message reserved. All of
        it follows from the settings, the node's size (which discovery tells) and its ledger: no record's value."""
        out: dict[str, float | int | str] = {
            "sigma": self.sigma,
            "q": self.q,
            "steps": self.reserved,
            "delta": self.delta,
            "clip": self.clip,
            "accountant": self.accountant,
        }
        return out | ({"guarantee": privacy.UNSEEDED} if self.seeded else {"epsilon": self.epsilon})

    def _sigma(self, book: dict, q: float, per_round: int) -> float:
        """dp-noise-multiplier, or the σ with which `rounds` rounds of `per_round` steps at q spend
        dp-epsilon (kept in the book: a forked process finds it there)."""
        if self.given > 0:
            return self.given
        steps = self.rounds * per_round
        key = f"{self.cap!r} {self.delta!r} {q!r} {steps}"
        kept = book.setdefault(SIGMAS, {})
        if key not in kept:
            kept[key] = record_dp.record_sigma(self.cap, self.delta, q, steps)[0]
            for old in list(kept)[:-KEPT_CALIBRATIONS]:
                del kept[old]
        return float(kept[key])


def most(count: int, within: Callable[[int], bool]) -> int:
    """The most steps k ≤ `count` with `within(k)` (which holds for 0 and, once false, for no larger k)."""
    if within(count):
        return count
    low, high = 0, count  # within(low), not within(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if within(mid) else (low, mid)
    return low


def record_ledger(node: Node) -> RecordLedger:
    """This message's record-level ledger (one per message, shared by the node's copies: kNN-Per's
    phase 2 trains a copy with its validation split joined)."""
    if "ledger" not in node.record_session:
        node.record_session["ledger"] = RecordLedger(node)
    return node.record_session["ledger"]


@contextlib.contextmanager
def _locked(files: NodeState) -> Iterator[None]:
    """The book to this process alone (a node may answer two messages at once)."""
    import fcntl

    lock = files.path(".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
