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


class TaskPolls:
    """When a warm executor asks its SuperNode for the next task. Without wake-ups, quickly after
    each task, slower while none comes. With them (the SuperNode says when it has pulled a
    message), quickly only while a pulled message's task is not taken yet, else only the
    safety net (`cap`) in case one is missed: quick polls were ~30 requests a message, for nothing.

    The SuperNode creates a message's task before it says it pulled it, so a poll may take the
    task before its wake-up comes; it takes one message at a time, so a task and its wake-up are
    never more than one apart (`untaken` stays in -1..1: a lost wake-up cannot make it deaf)."""

    def __init__(self, woken: bool):
        self.woken_too = woken
        self.backoff = Backoff(floor=0.01, cap=1.0 if woken else 0.25, ratio=0.05)
        self.untaken = 0  # wake-ups less tasks taken since
        self._count(0)

    def taken(self) -> None:
        """A task was taken."""
        self._count(-1) if self.woken_too else self.backoff.reset()

    def woken(self, count: int) -> None:
        """The SuperNode pulled `count` messages."""
        self._count(count)

    def delay(self) -> float:
        """Seconds to the next poll; a wake-up no task followed in a while (a message Flower dropped
        before it made its task) is forgotten."""
        if self.untaken > 0 and self.backoff.delay() >= self.backoff.cap:
            self._count(-self.untaken)
        return self.backoff.delay()

    def _count(self, change: int) -> None:
        self.untaken = max(-1, min(1, self.untaken + change))
        (self.backoff.reset if self.untaken > 0 or not self.woken_too else self.backoff.settle)()
