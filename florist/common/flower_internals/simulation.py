"""Flower 1.39's simulation engine hands a pushed message to its workers only when its extractor
thread next looks for one, every 0.1 s (`vce_api.add_messages_to_queue`): the messages of each
exchange waited 50 ms on average before any client started, a tenth of a 0.5 s round.
`quick_pickup` has the extractor look as soon as the ServerApp stores a message, and every 0.1 s
as before; what it does once it looks is Flower's. On another Flower nothing changes, without a
word: the stock engine only waits longer.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from florist.common import flower_internals

SAFETY_NET = 0.1  # seconds between looks when no store wakes the extractor: Flower's own interval
STOP_CHECK = 0.1  # seconds within which the extractor sees that the run has stopped, as with Flower's


def quick_pickup(safety_net: float = SAFETY_NET) -> bool:
    """From here on, this process's simulation engine picks up a stored message at once (once
    per process: a second call changes nothing). False (nothing changed) on another Flower."""
    if flower_internals.unusable("simulation") or flower_internals.installed() != flower_internals.PINNED:
        return False
    from flwr.server.superlink.fleet.vce import vce_api

    if getattr(vce_api.add_messages_to_queue, "quick", False):
        return True

    def add_messages_to_queue(state: Any, queue: Any, nodes_mapping: Any, f_stop: threading.Event) -> None:
        """Flower's extractor, waiting for a store (or `safety_net` seconds) between looks."""
        stored, store = threading.Event(), state.store_message_ins

        def store_and_wake(*args: Any, **kwargs: Any) -> Any:
            try:
                return store(*args, **kwargs)
            finally:
                stored.set()

        state.store_message_ins = store_and_wake  # the one state the ServerApp's Grid stores into too
        try:
            while not f_stop.is_set():
                stored.clear()  # before looking: a store during the look means one more look
                for node_id in nodes_mapping.keys():
                    for message in state.get_message_ins(node_id=node_id, limit=1):
                        queue.put(message)
                deadline = time.monotonic() + safety_net
                while not f_stop.is_set() and (left := deadline - time.monotonic()) > 0:
                    if stored.wait(min(left, STOP_CHECK)):
                        break
        finally:
            del state.store_message_ins

    add_messages_to_queue.quick = True  # type: ignore[attr-defined]
    add_messages_to_queue.stock = vce_api.add_messages_to_queue  # type: ignore[attr-defined]  (Flower's)
    vce_api.add_messages_to_queue = add_messages_to_queue
    return True
