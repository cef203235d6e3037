import time

from florist.common.pacing import Backoff


def test_the_delay_is_a_fraction_of_the_wait_within_floor_and_cap():
    now = time.monotonic()
    assert Backoff(floor=0.01, cap=1.0, ratio=0.1, since=now).delay() == 0.01  # just reset: the floor
    assert abs(Backoff(floor=0.01, cap=1.0, ratio=0.1, since=now - 4.0).delay() - 0.4) < 0.01
    assert Backoff(floor=0.01, cap=1.0, ratio=0.1, since=now - 60).delay() == 1.0  # long idle: the cap


def test_reset_makes_polling_quick_again_and_sleep_respects_at_most():
    backoff = Backoff(floor=0.01, cap=60.0, ratio=0.1, since=time.monotonic() - 6000)
    start = time.monotonic()
    backoff.sleep(at_most=0.02)
    assert time.monotonic() - start < 30  # not the 60 s cap: a bound no stall of a loaded machine reaches
    backoff.reset()
    assert backoff.delay() == 0.01


def test_a_deadline_already_passed_means_no_sleep_not_an_error():
    # The poll before the sleep can outlast the deadline (a slow pull): at_most is then negative.
    start = time.monotonic()
    Backoff(floor=60.0, cap=60.0, ratio=0.1).sleep(at_most=-0.3)
    assert time.monotonic() - start < 30  # not the 60 s floor: a bound no stall of a loaded machine reaches


def test_settle_polls_at_the_cap_until_reset():
    backoff = Backoff(floor=0.01, cap=1.0, ratio=0.1)
    backoff.settle()
    assert backoff.delay() == 1.0
    backoff.reset()
    assert backoff.delay() == 0.01
