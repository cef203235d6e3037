"""How the `florist` command takes Ctrl-C and SIGTERM: the first stops what a command started,
a second one cannot cut that stop short."""

from __future__ import annotations

import signal


def ignore_signals() -> None:
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)


def forget_interrupt() -> None:
    """CPython (3.11) records a KeyboardInterrupt that escapes code run by `exec` (imports run
    such code: dataclasses, typing, pydantic) even when it is caught later, and then ends the
    process by SIGINT instead of with our exit status. A successful `exec` clears the record."""
    exec("")


def interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM both raise KeyboardInterrupt, so the processes we started are stopped
    either way (and Ctrl-C works even where the shell started us with SIGINT ignored). Only the
    first does: a second Ctrl-C, pressed while that stop runs (a few seconds), would cut it
    short and leave processes behind."""

    def interrupt(*_: object) -> None:
        ignore_signals()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
