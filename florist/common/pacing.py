"""Polling that is quick right after something happened and slows down while nothing does.

Flower's deployment runtime polls at fixed intervals (a SuperNode sleeps 3 s after every pull
that finds no message; its SuperExec polls every second). A delay proportional to how long we
have been waiting keeps the latency a poll adds to a small fraction (`ratio`) of the wait,
while a federation that idles polls only every `cap` seconds.
"""

from __future__ import annotations

import dataclasses
import math
import time


@dataclasses.dataclass
class Backoff:
    """`delay()` = `ratio` × seconds since `reset()`, clamped to [`floor`, `cap`]."""

    floor: float = 0.01
    cap: float = 1.0
    ratio: float = 0.1
    since: float = dataclasses.field(default_factory=time.monotonic)

    def reset(self) -> None:
        """Something happened: poll quickly again."""
        self.since = time.monotonic()

    def settle(self) -> None:
        """Nothing is expected before a wake-up says so: poll only every `cap` seconds."""
        self.since = -math.inf

    def delay(self) -> float:
        return min(self.cap, max(self.floor, self.ratio * (time.monotonic() - self.since)))

    def sleep(self, at_most: float = math.inf) -> None:
        """Sleep `delay()`, but no longer than `at_most` (a deadline already passed: not at all)."""
        time.sleep(max(0.0, min(at_most, self.delay())))
