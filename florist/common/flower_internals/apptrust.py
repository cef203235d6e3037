"""A SuperNode that runs only the app bundles its box trusts.

Flower 1.39's SuperNode fetches a run's app bundle (FAB) from the SuperLink when the run's first
message arrives, stores it, and makes a task that its executor hands to a ClientApp process,
which installs the bundle and imports its code. Flower's own check there (`--trusted-entities`)
needs the SuperLink to vouch for the bundle with a license the open-source SuperLink never
gives, so a box would run whatever a SuperLink sends. `refuse_untrusted_apps` puts florist's
check at the same place (`start_client_internal._pull_and_store_message`, where Flower's check
is): a bundle whose sha256 is not trusted is never fetched, stored or made a task of; the node
answers the message with an error reply (`ErrorCode.INVALID_FAB`) and logs one line. A bundle
that is fetched must hash to what the SuperLink announced. Every executor takes its tasks from
the SuperNode, so this holds for florist's warm executor, its stock processes and Flower's own
SuperExec alike.

It is applied whatever the Flower version, as long as the code it wraps reads as it did in
1.39.0 (`problems`); where it does not, the caller refuses to start: a box that asked for the
check never runs without it.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("flwr").getChild(__name__)

# What `_pull_and_store_message` must still do, in this order, for the wrapper to hold.
STEPS = ("run_info = get_run(run_id)", "fab = get_fab(run_info.fab_hash, run_id)", "state.store_fab(fab)")


class Refused(Exception):
    """A bundle this box does not run: `reason` goes to the server, `line` to the box's log."""

    def __init__(self, fab_hash: str, reason: str, line: str):
        super().__init__(reason)
        self.fab_hash, self.reason, self.line = fab_hash, reason, line


def problems() -> list[str]:
    """What the installed Flower lacks of what the gate wraps (empty: it can be applied)."""
    try:
        from flwr.supernode import start_client_internal as sci
        from flwr.supernode.cli import flower_supernode  # noqa: F401  (run in this process, not exec'd)
    except ImportError as err:
        return [f"no SuperNode to run in this process ({err})"]
    names = ("_pull_and_store_message", "_insert_message")
    if found := [f"no {name} in start_client_internal" for name in names if not hasattr(sci, name)]:
        return found
    source = inspect.getsource(sci._pull_and_store_message)
    places = [source.find(step) for step in STEPS]
    if -1 in places or places != sorted(places):
        return ["_pull_and_store_message no longer gets the run, then its FAB, then stores it, as florist reads it"]
    parameters = inspect.signature(sci._pull_and_store_message).parameters
    return [f"_pull_and_store_message has no {n} parameter" for n in ("receive", "get_fab") if n not in parameters]


def refuse_untrusted_apps(judge: Callable[[str], Refused | None]) -> None:
    """In this process, the SuperNode fetches and runs only bundles that `judge(sha256)` passes
    (it returns None) and answers a message of any other run with an error reply. RuntimeError,
    naming what differs, on a Flower where this cannot be done."""
    if found := problems():
        raise RuntimeError("; ".join(found))
    from flwr.supernode import start_client_internal as sci

    pull, logged = sci._pull_and_store_message, set()

    def pull_and_store(*args: Any, receive: Callable[[], Any], get_fab: Callable[[str, int], Any], **kwargs: Any):
        pulled: list[Any] = []

        def receive_one() -> Any:
            if (got := receive()) is not None:
                pulled[:] = [got[0]]
            return got

        try:
            return pull(*args, receive=receive_one, get_fab=_checked(get_fab, judge), **kwargs)
        except Refused as refused:
            message = pulled[0]
            if (refused.fab_hash, message.metadata.run_id) not in logged:  # one line per run, not per message
                logged.add((refused.fab_hash, message.metadata.run_id))
                log.error("run %s: %s", message.metadata.run_id, refused.line)
            _reply_error(sci, message, refused.reason, kwargs)
            return message.metadata.run_id

    sci._pull_and_store_message = pull_and_store


def _checked(get_fab: Callable[[str, int], Any], judge: Callable[[str], Refused | None]) -> Callable[[str, int], Any]:
    """`get_fab` that asks `judge` before it fetches a bundle, and checks what it fetched."""

    def get_checked_fab(fab_hash: str, run_id: int) -> Any:
        if refused := judge(fab_hash):
            raise refused
        fab = get_fab(fab_hash, run_id)
        if (actual := hashlib.sha256(fab.content).hexdigest()) != fab_hash:
            raise Refused(
                actual,
                "app bundle refused: its content does not match the hash it was announced with",
                f"refused the app bundle announced as {fab_hash}: its content hashes to {actual}",
            )
        return fab

    return get_checked_fab


def _reply_error(sci: Any, message: Any, reason: str, kwargs: dict[str, Any]) -> None:
    """Answer `message` with an INVALID_FAB error reply, as Flower's own FAB check does."""
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode

    state, store = kwargs["state"], kwargs["object_store"]
    sci._insert_message(Message(Error(ErrorCode.INVALID_FAB, reason), reply_to=message), state, store)
