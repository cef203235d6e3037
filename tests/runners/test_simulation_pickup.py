"""A simulation's clients get each exchange's messages when the ServerApp stores them, not at the
engine's next look (`flower_internals/simulation.py`)."""

import threading

from flwr.server.superlink.fleet.vce import vce_api

from florist.common.flower_internals.simulation import quick_pickup
from florist.config import RunConfig
from florist.runners.simulation import client_resources, simulate


def test_a_run_completes_when_the_engine_looks_only_when_woken(tmp_path, monkeypatch):
    """With the engine's own looks an hour apart, a run's exchanges go on only if storing a message
    wakes it: the run ends (within the join's bound) with every client scored, as it does on Flower's
    0.1 s looks."""
    # Flower's extractor, even where an earlier simulation in this process installed the quick one
    # (which `quick_pickup` would keep, with its 0.1 s looks): restored after the test
    current = vce_api.add_messages_to_queue
    monkeypatch.setattr(vce_api, "add_messages_to_queue", getattr(current, "stock", current))
    assert quick_pickup(safety_net=3600)
    assert vce_api.add_messages_to_queue is not current
    cfg = RunConfig.from_mapping({"num-server-rounds": 2, "min-nodes": 2, "results-dir": str(tmp_path)})
    done: dict = {}
    run = threading.Thread(target=lambda: done.update(simulate(cfg, 2, resources=client_resources(1.0, 0.0))))
    run.start()
    run.join(300)  # it takes about a minute; a missed wake-up would hold each exchange for the hour
    assert not run.is_alive(), "the simulation engine never picked up a stored message"
    assert done["complete"] and len(done["rounds"]) == 2 and not done["failures"]
