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
    monkeypatch.setattr(vce_api, "add_messages_to_queue", vce_api.add_messages_to_queue)  # restored after
    assert quick_pickup(safety_net=3600)
    cfg = RunConfig.from_mapping({"num-server-rounds": 2, "min-nodes": 2, "results-dir": str(tmp_path)})
    done: dict = {}
    run = threading.Thread(target=lambda: done.update(simulate(cfg, 2, resources=client_resources(1.0, 0.0))))
    run.start()
    run.join(300)  # it takes about a minute; a missed wake-up would hold each exchange for the hour
    assert not run.is_alive(), "the simulation engine never picked up a stored message"
    assert done["complete"] and len(done["rounds"]) == 2 and not done["failures"]
