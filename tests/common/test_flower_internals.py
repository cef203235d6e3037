"""The guard on florist's use of Flower internals: it passes on the pinned Flower; when what it
relies on is not there, `verify` fails naming both versions, and `mismatch`/`fast_path` say so in
one line while everything it gates falls back to Flower's stock behaviour."""

import sys
import threading
import time

import flwr
import pytest
from flwr.app import Message, RecordDict
from flwr.supercore.inflatable import inflatable_utils
from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore
from flwr.superlink.grid import http_grid
from flwr.supernode import start_client_internal as sci
from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState
from flwr.supernode.runtime import run_clientapp as clientapp_runtime

from florist.common import flower_internals
from florist.common.pacing import Backoff
from florist.runners.inprocess import server_identity

WARNING = "florist: Flower 1.39.1 is installed, florist's fast path was written for 1.39.0"


@pytest.fixture(autouse=True)
def _fresh_guard():
    """Each test works the guard out afresh, and leaves it to be worked out again after its changes."""
    flower_internals.forget()
    yield
    flower_internals.forget()


def test_the_pinned_flower_has_everything_the_fast_path_relies_on():
    assert flwr.__version__ == flower_internals.PINNED
    flower_internals.verify()
    assert flower_internals.mismatch() is None and flower_internals.fast_path()


def test_a_changed_half_upload_error_is_refused(monkeypatch):
    monkeypatch.setattr(flower_internals, "HALF_UPLOADED", "Reply objects went missing")
    with pytest.raises(RuntimeError, match="half-uploaded reply"):
        flower_internals.verify()
    assert "half-uploaded reply" in flower_internals.mismatch() and flower_internals.unusable("grid")


def test_a_grid_that_no_longer_pulls_objects_with_pull_objects_is_refused(monkeypatch):
    monkeypatch.setattr(http_grid.HttpGrid, "pull_messages", lambda self, message_ids: [])
    with pytest.raises(RuntimeError, match="no longer pulls a reply's objects"):
        flower_internals.verify()


def test_another_flower_is_refused_naming_both_versions(monkeypatch):
    monkeypatch.setattr(flwr, "__version__", "9.9.9")
    with pytest.raises(RuntimeError, match=r"written for Flower 1\.39\.0; the installed Flower 9\.9\.9"):
        flower_internals.verify()
    assert flower_internals.mismatch() == (
        "Flower 9.9.9 is installed, florist's fast path was written for 1.39.0 (the internals it checks are unchanged)"
    )


def test_a_changed_supernode_loop_is_refused(monkeypatch):
    monkeypatch.delattr(sci, "_push_messages")
    with pytest.raises(RuntimeError, match="no _push_messages in start_client_internal"):
        flower_internals.verify()
    assert flower_internals.unusable("supernode") == ["no _push_messages in start_client_internal"]


def test_a_moved_flower_module_is_a_difference_not_a_crash(monkeypatch):
    monkeypatch.setitem(sys.modules, "flwr.supercore.control", None)  # importing it raises ImportError
    why = flower_internals.mismatch()
    assert why.startswith("Flower 1.39.0 is installed, florist's fast path was written for 1.39.0 (control: ")
    assert "ModuleNotFoundError" in why and not flower_internals.fast_path()
    assert flower_internals.unusable("control") and not flower_internals.unusable("runtime")
    with pytest.raises(RuntimeError, match="control: ModuleNotFoundError"):
        flower_internals.verify()


def test_off_the_fast_path_nothing_is_patched_and_one_line_says_so(monkeypatch, capsys):
    monkeypatch.setattr(flwr, "__version__", "1.39.1")
    for name in ("_pull_and_store_message", "_push_messages", "time"):
        monkeypatch.setattr(sci, name, getattr(sci, name))  # restored after the test, should it change
    monkeypatch.setattr(clientapp_runtime, "install_from_fab", clientapp_runtime.install_from_fab)
    for pull in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        monkeypatch.setattr(pull, "__kwdefaults__", dict(pull.__kwdefaults__, initial_backoff=1, backoff_cap=10))
    before = (sci._pull_and_store_message, sci._push_messages, sci.time, clientapp_runtime.install_from_fab)
    assert not flower_internals.pace_supernode(Backoff())
    assert not flower_internals.quick_object_pulls() and not flower_internals.skip_installed_fabs()
    assert (sci._pull_and_store_message, sci._push_messages, sci.time, clientapp_runtime.install_from_fab) == before
    assert inflatable_utils.pull_objects.__kwdefaults__["initial_backoff"] == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [f"{WARNING} (the internals it checks are unchanged): using Flower's stock paths"]


def test_pacing_replaces_the_supernode_sleeps_and_object_pulls_start_fast(monkeypatch):
    monkeypatch.setattr(sci, "_pull_and_store_message", lambda *args, **kwargs: 42)  # a message arrives
    monkeypatch.setattr(sci, "_push_messages", lambda *args, **kwargs: None)
    monkeypatch.setattr(sci, "time", sci.time)  # restored after the test
    for pull in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        monkeypatch.setattr(pull, "__kwdefaults__", dict(pull.__kwdefaults__))
    backoff = Backoff(floor=0.01, cap=0.05, ratio=0.1, since=time.monotonic() - 100)
    flower_internals.pace_supernode(backoff)
    assert backoff.delay() == 0.05  # idle for long: the cap
    assert sci._pull_and_store_message(receive=lambda: None) == 42 and backoff.delay() == 0.01  # quick polling again
    start = time.monotonic()
    sci.time.sleep(60)  # as Flower's idle sleep after an empty pull, made long: unpaced, the test would take a minute
    assert time.monotonic() - start < 30  # the cap, 0.05 s; the margin is for a loaded machine
    assert sci.time.monotonic() > 0  # the rest of the time module is untouched
    assert inflatable_utils.pull_objects.__kwdefaults__["initial_backoff"] == 0.01
    assert inflatable_utils.pull_and_inflate_object_from_tree.__kwdefaults__["backoff_cap"] == 0.2


def test_the_reply_to_the_message_just_pulled_goes_out_even_when_a_stale_reply_goes_first(monkeypatch):
    """Flower's own push, on a real node state: a reply to a message of a run that ended while the
    node was cut off is still there when the next run's message is pulled. Flower pushes it
    (the SuperLink ignores it) and would go back to pulling, the new reply never sent."""
    for name in ("_pull_and_store_message", "_push_messages", "time"):
        monkeypatch.setattr(sci, name, getattr(sci, name))  # restored after the test
    store = InMemoryObjectStore()
    state = InMemoryNodeState(store)
    with server_identity(7):
        stale = Message(RecordDict(), dst_node_id=1, message_type="train", group_id="2")
        live = Message(RecordDict(), dst_node_id=1, message_type="query.info", group_id="0")
    stale.metadata.__dict__["_message_id"], live.metadata.__dict__["_message_id"] = stale.object_id, live.object_id
    state.store_message(stale)
    sci._insert_message(Message(RecordDict(), reply_to=stale), state, store)

    def pull(*, state, receive, **_):
        message, _ = receive()
        state.store_message(message)
        return message.metadata.run_id

    def reply_later():
        time.sleep(0.3)  # its ClientApp takes a while
        sci._insert_message(Message(RecordDict(), reply_to=live), state, store)

    sent = []

    def send(message, object_tree, runtime):
        sent.append(message.metadata.reply_to_message_id)
        return set(), "session"

    monkeypatch.setattr(sci, "_pull_and_store_message", pull)
    flower_internals.pace_supernode(Backoff())
    assert sci._pull_and_store_message(state=state, object_store=store, receive=lambda: (live, None)) == 7
    threading.Thread(target=reply_later).start()
    sci._push_messages(state=state, object_store=store, send=send, push_object=lambda *args: None)
    assert sent == [stale.metadata.message_id, live.metadata.message_id]
    assert not state.get_messages()


class GridWithObjectsThatNeverArrive(http_grid.HttpGrid):
    """Flower's deployment Grid as far as `pull_replies` can tell (its class), which pulls one
    reply's objects the way that Grid does (through `http_grid`'s `pull_objects`), for an object
    that is never pushed."""

    def __init__(self):  # no SuperLink to connect to
        pass

    def pull_messages(self, message_ids):
        def never_there(object_id):
            raise inflatable_utils.ObjectUnavailableError(object_id)

        try:  # retries every 10 ms, for ever: only `max_time` ends it (Flower's own is 2 h)
            http_grid.pull_objects(
                ["a" * 64], never_there, initial_backoff=0.01, backoff_cap=0.01, max_tries_per_object=None
            )
        except inflatable_utils.ObjectPullError:
            return [f"gave up on {message_ids}"]
        return []


def test_pull_replies_gives_up_on_missing_objects_at_the_deadline_and_says_when_it_started_on_them():
    started = []
    start = time.monotonic()
    replies = flower_internals.pull_replies(
        GridWithObjectsThatNeverArrive(), ["m"], start + 0.3, 0.0, lambda: started.append(time.monotonic())
    )
    assert replies == ["gave up on ['m']"] and len(started) == 1
    assert 0.3 <= time.monotonic() - start < 10  # it gives up: without a deadline it would pull forever


def test_pull_replies_past_its_deadline_still_gives_a_reply_at_least_its_minimum():
    start = time.monotonic()
    assert flower_internals.pull_replies(GridWithObjectsThatNeverArrive(), ["m"], start - 5, 0.3) == [
        "gave up on ['m']"
    ]
    assert 0.3 <= time.monotonic() - start < 10  # it gives up: without a deadline it would pull forever


def test_pull_replies_calls_any_other_grid_as_stock_flower_would_without_consulting_the_guard(monkeypatch):
    def consulted():
        raise AssertionError("the guard was consulted")

    monkeypatch.setattr(flower_internals, "fast_path", consulted)
    monkeypatch.setattr(flower_internals, "mismatch", consulted)

    class SimulationGrid:  # e.g. Flower's InMemoryGrid: replies are held whole
        def pull_messages(self, message_ids):
            return [f"reply to {i}" for i in message_ids]

    started = []
    replies = flower_internals.pull_replies(SimulationGrid(), ["a", "b"], time.monotonic() + 1, 0.0, started.append)
    assert replies == ["reply to a", "reply to b"] and not started


class StockDeploymentGrid(GridWithObjectsThatNeverArrive):
    def pull_messages(self, message_ids):
        self.pull_objects = http_grid.pull_objects
        return [f"reply to {i}" for i in message_ids]


def test_off_the_fast_path_the_deployment_grid_is_pulled_as_flower_pulls_it(monkeypatch, capsys):
    monkeypatch.setattr(flwr, "__version__", "1.39.1")
    monkeypatch.setattr(http_grid, "pull_objects", inflatable_utils.pull_objects)  # as Flower has it
    grid, started = StockDeploymentGrid(), []
    for _ in range(2):
        assert flower_internals.pull_replies(grid, ["m"], time.monotonic() + 1, 0.0, lambda: started.append(1)) == [
            "reply to m"
        ]
    assert grid.pull_objects is inflatable_utils.pull_objects and not started
    assert capsys.readouterr().err.count(WARNING) == 1


def test_a_changed_simulation_engine_leaves_its_extractor_alone_without_a_word(monkeypatch, capsys):
    from flwr.server.superlink.fleet.vce import vce_api

    from florist.common.flower_internals.simulation import quick_pickup

    stock = vce_api.add_messages_to_queue
    monkeypatch.setattr(vce_api, "run_api", lambda *args: None)  # no longer reads its factory's LinkState
    assert flower_internals.unusable("simulation") == [
        "the simulation engine no longer reads the one LinkState of its factory"
    ]
    assert quick_pickup() is False and vce_api.add_messages_to_queue is stock
    assert capsys.readouterr().err == ""  # a simulation says nothing: it only waits as Flower's does
