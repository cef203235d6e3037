"""A handler that outlives its message is stopped, so that its node can take the next one.

florist's server sends every message with a time-to-live of `round-timeout`: past
`created_at + ttl` nobody waits for the reply. A SuperNode, though, takes its next message
only once its ClientApp has answered the last one, so a handler that hangs would keep the node
out of every later round. At the deadline the handler is therefore interrupted with a
TimeoutError (SIGALRM, in the main thread, where Flower's process runtimes call the ClientApp):
Flower turns it into an error reply and the node is free again.

A handler stuck in native code never gets back to Python to see that exception. In a process
that exists for this one message (the warm executor's children and the stock processes it
starts carry `FLORIST_DISPOSABLE_PROCESS`), faulthandler's watchdog, which needs no GIL, ends
the process `HARD_STOP_GRACE` seconds later and prints where every thread was.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # kept light: the warm executor imports this module before numpy
    from flwr.app import Message

DISPOSABLE = "FLORIST_DISPOSABLE_PROCESS"
HARD_STOP_GRACE = 10.0


class DeadlineExceeded(TimeoutError):
    pass


@contextlib.contextmanager
def deadline(msg: Message, longest: float | None = None) -> Iterator[None]:
    """Run the block until `msg` expires, or for `longest` seconds at most (the node's own cap,
    `client/guard.py`); raise DeadlineExceeded in it when it does. Never longer than the
    message's time-to-live, whatever its `created_at` says."""
    ttl = msg.metadata.ttl
    remaining = msg.metadata.created_at + ttl - time.time()
    if remaining <= 0:
        raise DeadlineExceeded(f"the message expired {-remaining:.1f} s before its handler started (ttl {ttl:g} s)")
    remaining = min(remaining, ttl, longest or ttl)
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return

    def expire(*_: object) -> None:
        if longest is not None and longest < ttl:
            raise DeadlineExceeded(f"the handler ran past this node's cap of {longest:g} s (node-max-seconds)")
        raise DeadlineExceeded(f"the handler ran past its message's deadline ({ttl:g} s after it was sent)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, remaining)
    if os.environ.get(DISPOSABLE):
        faulthandler.dump_traceback_later(remaining + HARD_STOP_GRACE, exit=True)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if os.environ.get(DISPOSABLE):
            faulthandler.cancel_dump_traceback_later()
