"""Real SuperLink + SuperNodes with TLS and SuperNode auth (what `florist deploy-local --tls
--auth` starts, which turns `bind-node-keys` on): a SuperNode with another registered auth key
that claims a node key the run bound to another SuperNode is refused, named, and the run
resumes once the real node is back (its auth key gives it the same node id).

Every process is started by the test's LocalFederation and stopped by PID; every wait is bounded.
"""

import json
import subprocess
import time

from processes import RUN, node_configs, submit

from florist.deploy.federation import LocalFederation
from florist.server.checkpoint import Checkpoint


def _wait_for_online(fed: LocalFederation, count: int, timeout: float = 120.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(online := fed.online_nodes()) != count:
        assert time.monotonic() < deadline, f"{len(online)} SuperNodes online, expected {count}"
        time.sleep(0.5)
    return online


def _stop_node(fed: LocalFederation, i: int) -> None:
    fed.nodes[i].popen.terminate()
    fed.nodes[i].popen.wait(30)
    fed.nodes[i] = None


def test_another_auth_key_claiming_a_bound_node_key_is_refused_and_the_real_node_resumes(tmp_path):
    configs = node_configs(3, tmp_path)
    configs[2] |= {"node-key": "partition-0"}  # an impostor: an auth key of its own, registered; node 0's name
    out = tmp_path / "out"
    config = RUN | {"num-server-rounds": 1, "min-nodes": 2, "bind-node-keys": True, "results-dir": str(out)}
    fed = LocalFederation(tmp_path, configs, tls=True, auth=True, persistent=True)
    try:
        fed.start(num_started=2)
        assert (fed.certs / "ca.crt").is_file() and not (fed.certs / "ca.key").exists()  # a one-federation CA
        first = submit(fed, out, **config)
        assert first["complete"]
        bound = Checkpoint.load(out).bindings
        assert sorted(bound) == ["partition-0", "partition-1"] and sorted(bound.values()) == fed.online_nodes()

        _stop_node(fed, 0)
        fed.start_node(2)
        impostor = (set(_wait_for_online(fed, 2)) - set(bound.values())).pop()
        resume = config | {"resume-from": str(out)}
        refused = subprocess.run(fed.run_command(resume), env=fed.env, capture_output=True, text=True, timeout=600)
        said = refused.stdout + refused.stderr
        assert f"node key 'partition-0' is bound to SuperNode {bound['partition-0']}" in said, said[-3000:]
        assert "partition-0 of the run did not connect" in said, said[-3000:]
        assert json.loads((out / "results.json").read_text()) == first  # nothing saved was lost
        assert impostor not in bound.values()

        _stop_node(fed, 2)
        fed.start_node(0)  # the real node 0: same auth key, so the same node id
        assert sorted(_wait_for_online(fed, 2)) == sorted(bound.values())
        resumed = submit(fed, out, **resume)
        assert resumed["complete"]
        assert {c["client"]: c["accuracy"] for c in resumed["clients"]} == {
            c["client"]: c["accuracy"] for c in first["clients"]
        }
    finally:
        fed.stop()
