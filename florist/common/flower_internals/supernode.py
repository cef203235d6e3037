"""The SuperNode's polling and the object pulls of every side, quicker than Flower 1.39 makes them:

- a SuperNode sleeps 3 s after every pull that finds no message and 0.5 s between checks for
  its ClientApp's reply (`flwr/supernode/start_client_internal.py`): `pace_supernode` replaces
  those sleeps with a `Backoff` in that module only;
- whoever pulls a message's objects (SuperNode from SuperLink, ClientApp from SuperNode,
  ServerApp its replies) and finds one not pushed yet waits 1 s, then 2, 4, ... up to 10 s
  (`flwr/supercore/inflatable/inflatable_utils.py`); with fast polling that is the common
  case, so `quick_object_pulls` starts those waits at 10 ms, capped at 0.2 s (and bounds them
  by Flower's 2 h limit on the whole pull, not by 500 tries);
- the ServerApp's Grid takes replies off the SuperLink, then pulls their objects one reply after
  the other (`flwr/superlink/grid/http_grid.py`): a reply whose sender was cut off mid-upload
  would hold that poll for Flower's 2 h, and every reply behind it. `pull_replies` bounds each
  reply's pull by the round's deadline (the Grid then answers with an error whose reason starts
  with `HALF_UPLOADED`) and says when a poll has got that far, so that the next one can start
  beside it. It also stops pulling a reply's objects once they pass the exchange's size cap
  (`max-reply-mb`): the Grid then answers with the same error, its reason naming the bytes
  pulled and the cap (`flower_internals.oversized`), and a 2 GB reply is never pulled whole.

Each does nothing (Flower's stock behaviour) unless `fast_path()` says yes.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from florist.common import flower_internals
from florist.common.pacing import Backoff


class _PacedTime:
    """Stands in for the `time` module inside `start_client_internal`: its fixed sleeps become
    `Backoff` delays (never longer than what Flower asked for), cut short by `wake`."""

    def __init__(self, backoff: Backoff, wake: threading.Event):
        self.backoff, self.wake = backoff, wake

    def sleep(self, seconds: float) -> None:
        self.wake.wait(min(seconds, self.backoff.delay()))
        self.wake.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def quick_object_pulls() -> bool:
    """In this process, retry an object that is not there yet after 10 ms, doubling up to
    0.2 s (instead of 1 s doubling up to 10 s). False (nothing changed) off the fast path."""
    if not flower_internals.fast_path():
        return False
    from flwr.supercore.inflatable import inflatable_utils

    for pull in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        pull.__kwdefaults__.update(initial_backoff=0.01, backoff_cap=0.2, max_tries_per_object=None)
    return True


_poll = threading.local()  # the bounds and hook of the `pull_replies` this thread runs
_patching = threading.Lock()


def pull_replies(
    grid: Any,
    message_ids: list[str],
    until: float,
    at_least: float,
    on_objects: Callable[[], None] = lambda: None,
    cap: int | None = None,
) -> list[Any]:
    """`grid.pull_messages(message_ids)`, except that Flower's deployment Grid, on the fast
    path, gives up on a reply whose objects are not all there at `until` (`time.monotonic()`),
    though never sooner than `at_least` seconds after it starts pulling them, and calls
    `on_objects()` whenever it starts: by then the replies it returns are off the SuperLink, so
    another poll cannot get them too. It also stops pulling a reply once the bytes of its
    objects pass `cap` (None: no cap): the Grid makes that reply an error reply. Any other
    Grid (simulation's, the in-process one), or stock Flower off the fast path, holds or pulls
    replies whole: it is called as stock Flower would, never calls `on_objects`, the guard is
    not consulted, and a reply over its cap is refused only once it is all there
    (`Exchanger`)."""
    if not _bounded(grid):
        return list(grid.pull_messages(message_ids))
    _poll.until, _poll.at_least, _poll.on_objects, _poll.cap = until, at_least, on_objects, cap
    try:
        return list(grid.pull_messages(message_ids))
    finally:
        del _poll.until


def _bounded(grid: Any) -> bool:
    """Whether `grid` is Flower's deployment Grid and its pulls are bounded (patched once per
    process, on the fast path only)."""
    http_grid = sys.modules.get("flwr.superlink.grid.http_grid")  # not imported: not the deployment Grid
    grid_class = getattr(http_grid, "HttpGrid", None)
    if not (isinstance(grid_class, type) and isinstance(grid, grid_class)) or not flower_internals.fast_path():
        return False
    with _patching:
        if http_grid.pull_objects is not _bounded_pull_objects:
            quick_object_pulls()  # replies are pulled as soon as they are there
            http_grid.pull_objects = _bounded_pull_objects
    return True


def _bounded_pull_objects(*args: Any, **kwargs: Any) -> Any:
    """Flower's `pull_objects`, as the Grid calls it, within the bounds of this thread's poll."""
    from flwr.supercore.inflatable import inflatable_utils

    if (until := getattr(_poll, "until", None)) is not None:
        _poll.on_objects()
        kwargs["max_time"] = max(until - time.monotonic(), _poll.at_least)
        if _poll.cap is not None and "pull_object_fn" in kwargs:  # as the Grid calls it
            kwargs["pull_object_fn"] = _capped(kwargs["pull_object_fn"], _poll.cap)
        elif _poll.cap is not None and len(args) > 1:
            args = (args[0], _capped(args[1], _poll.cap), *args[2:])
    return inflatable_utils.pull_objects(*args, **kwargs)


def _capped(pull_object_fn: Callable[[str], bytes], cap: int) -> Callable[[str], bytes]:
    """`pull_object_fn` (one object's bytes by id, called from Flower's pull threads) that
    raises Flower's `ObjectPullError` once the reply it pulls weighs more than `cap`: Flower then
    stops the pull (its other threads finish the object each is pulling, at most
    `FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS` chunks of 5 MB) and drops what it had. A reply
    weighs the bytes of its objects, or, when more, what its Arrays declare they are cut into:
    an Array may name one 5 MB chunk 400 times, 2 GB once inflated, for 5 MB pulled."""
    from flwr.supercore.inflatable.inflatable_utils import ObjectPullError

    counted, lock = {"other": 0, "chunks": 0, "declared": 0}, threading.Lock()

    def pull(object_id: str) -> bytes:
        content = pull_object_fn(object_id)
        kind, declared = _weigh(content)
        with lock:
            counted["chunks" if kind == "ArrayChunk" else "other"] += len(content)
            counted["declared"] += declared
            total = counted["other"] + max(counted["chunks"], counted["declared"])
        if total > cap:
            raise ObjectPullError(object_id, f"{flower_internals.OVERSIZED} {total} bytes pulled, cap {cap} bytes")
        return content

    return pull


def _weigh(content: bytes) -> tuple[str, int]:
    """An object's type, and for an Array, the fewest bytes its chunks can hold once inflated
    (all but the last of them full; 0 where it cannot be read: Flower refuses it itself)."""
    import json

    from flwr.app import Array
    from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
    from flwr.supercore.inflatable.inflatable_object import get_object_body, get_object_type_from_object_content

    try:
        kind = get_object_type_from_object_content(content)
        if kind != "Array":
            return kind, 0
        chunks = len(json.loads(get_object_body(content, Array))["arraychunk_ids"])
    except Exception:
        return "", 0
    return kind, max(chunks - 1, 0) * FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE


def pace_supernode(
    backoff: Backoff, wake: threading.Event | None = None, on_message: Callable[[], None] | None = None
) -> bool:
    """Make this process's SuperNode poll with `backoff`, reset whenever a message arrives and
    when its reply has gone out, and pull objects quickly. Setting `wake` ends a wait at once
    (e.g. when a reply is there); `on_message` is called for every message pulled. Off the fast
    path it does nothing and says False: the SuperNode polls as Flower's does.

    Also, the reply to the message just pulled is always pushed before the next pull: Flower
    pushes whatever replies are there, and a reply left over from a message it gave up on (its
    run ended while the node was cut off) would otherwise go out in its place, the new reply
    left unsent until the next message comes, which the server sends only after it has given up
    waiting for this reply."""
    if not quick_object_pulls():
        return False
    from flwr.supernode import start_client_internal as sci

    pull, push = sci._pull_and_store_message, sci._push_messages
    pulled: list[str] = []  # the id of the message the last pull stored, until its reply is pushed

    def pull_and_store(*args: Any, receive: Callable[[], Any], **kwargs: Any) -> int | None:
        def receive_one() -> Any:
            if (got := receive()) is not None:
                pulled.append(got[0].metadata.message_id)
            return got

        pulled.clear()
        run_id = pull(*args, receive=receive_one, **kwargs)
        if run_id is None:  # nothing came, or Flower dropped what did
            pulled.clear()
        else:
            backoff.reset()
            if on_message:
                on_message()
        return run_id

    def push_replies(*args: Any, send: Callable[..., Any], **kwargs: Any) -> None:
        replied: set[str] = set()

        def send_one(message: Any, *rest: Any) -> Any:
            replied.add(message.metadata.reply_to_message_id)  # sent, or refused: either way it is gone
            return send(message, *rest)

        try:
            push(*args, send=send_one, **kwargs)
            while not replied.issuperset(pulled):
                push(*args, send=send_one, **kwargs)
        finally:
            pulled.clear()
            backoff.reset()

    sci._pull_and_store_message, sci._push_messages = pull_and_store, push_replies
    sci.time = _PacedTime(backoff, wake or threading.Event())
    return True


def supernode_main(argv: list[str]) -> None:
    """Flower's `flower-supernode` with these arguments, in this process (on a Flower that moved
    its entry point, its executable in place of this process)."""
    try:
        from flwr.supernode.cli import flower_supernode
    except ImportError:
        import os
        from pathlib import Path

        beside = Path(sys.executable).with_name("flower-supernode")  # this environment's, venv or not
        program = str(beside) if beside.exists() else "flower-supernode"
        os.execvp(program, ["flower-supernode", *argv])  # never returns
    else:
        sys.argv = ["flower-supernode", *argv]
        flower_supernode()
