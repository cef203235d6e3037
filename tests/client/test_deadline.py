"""A handler that outlives its message is stopped; one that finishes leaves no alarm behind."""

import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from florist.client.deadline import DeadlineExceeded, deadline


def message(ttl: float, age: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(metadata=SimpleNamespace(created_at=time.time() - age, ttl=ttl))


def test_a_handler_running_past_its_deadline_is_interrupted():
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="past its message's deadline"), deadline(message(ttl=0.3)):
        time.sleep(30)
    assert time.monotonic() - start < 15  # 0.3 s; the margin is for a loaded machine
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_message_that_expired_before_its_handler_started_is_refused_at_once():
    with pytest.raises(DeadlineExceeded, match="expired 5.0 s before"), deadline(message(ttl=10, age=15)):
        pytest.fail("the handler must not run")


def test_a_handler_that_finishes_in_time_leaves_no_alarm_and_the_old_handler_back():
    before = signal.getsignal(signal.SIGALRM)
    with deadline(message(ttl=60)):
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 50
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) is before


def test_outside_the_main_thread_the_handler_runs_untouched():
    outcome = []

    def run() -> None:
        with deadline(message(ttl=0.2)):
            time.sleep(0.5)
        outcome.append("finished")

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert outcome == ["finished"]


def test_a_disposable_process_stuck_where_python_cannot_interrupt_it_is_ended():
    code = """
import os, signal, time
from types import SimpleNamespace
os.environ["FLORIST_DISPOSABLE_PROCESS"] = "1"
from florist.client import deadline as d
d.HARD_STOP_GRACE = 0.5
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # the soft deadline can never fire
with d.deadline(SimpleNamespace(metadata=SimpleNamespace(created_at=time.time(), ttl=0.5))):
    time.sleep(300)
"""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and time.monotonic() - start < 200  # not the 300 s sleep; imports are slow under load
    assert "Timeout" in done.stderr and "Thread" in done.stderr  # where it was stuck, for the node's log
