"""Real processes on a private virtual network (`florist deploy-local --netns`): the SuperLink
and each SuperNode in a network namespace of its own, with its own address, as on separate
devices. The run matches the same run on loopback, a node whose link goes down mid-run is
left out and comes back, and only the Fleet port can be reached from another host.

Everything here is made by the test and removed even when it fails; every wait is bounded.
Needs root (network namespaces); skipped, saying why, where one cannot be made.
"""

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from processes import RUN, node_configs, submit, wait_for_rounds

from florist.cli import main
from florist.common.processes import marked
from florist.config import RunConfig
from florist.deploy import netns
from florist.deploy.federation import LocalFederation
from florist.runners.inprocess import run_in_process

NODES = 2


@pytest.fixture(scope="module")
def usable():
    if reason := netns.probe():
        pytest.skip(f"network namespaces cannot be made here: {reason}")


@pytest.fixture(scope="module")
def federation(usable, tmp_path_factory):
    """A TLS + node-auth federation on its own network, shared by the tests below."""
    root = tmp_path_factory.mktemp("netns")
    with (
        netns.Network.for_federation(NODES) as network,
        LocalFederation(root, node_configs(NODES, root), tls=True, auth=True, network=network) as fed,
    ):
        yield fed


@pytest.fixture(scope="module")
def trained(federation, tmp_path_factory):
    """The 2-round run the first test compares; it also installs the app bundle on every node,
    so that no later run's first message waits for the install."""
    return submit(federation, tmp_path_factory.mktemp("netns-run") / "out", **{"num-server-rounds": 2})


def test_a_tls_auth_run_across_namespaces_matches_the_same_run_on_loopback(trained, tmp_path):
    """The reference is the in-process federation, which gives the same accuracies as a loopback
    deployment to the last digit (tests/deploy/test_superlink_crash.py), at a fraction of the cost."""
    assert trained["complete"] and not trained["failures"] and len(trained["rounds"]) == 2
    config = RUN | {"min-nodes": NODES, "num-server-rounds": 2, "results-dir": str(tmp_path / "out")}
    reference = run_in_process(RunConfig.from_mapping(config), NODES)
    accuracies = {c["client"]: c["accuracy"] for c in trained["clients"]}
    assert accuracies == {c["client"]: c["accuracy"] for c in reference["clients"]}
    assert len(accuracies) == NODES and None not in accuracies.values()


def test_a_node_whose_link_goes_down_is_left_out_and_comes_back(federation, trained, tmp_path):
    """Node 1's link goes down as round 2 starts (its message is out) and comes back up once
    round 2 is over: round 2 ends without it after `round-timeout`; the node is back in round 3,
    or in round 4 if its TCP connection's retransmission timer, which doubled while the link was
    down, fires after round 3's timeout; round 5 is the margin."""
    fed, network, timeout = federation, federation.network, 8.0
    out = tmp_path / "out"
    config = RUN | {
        "min-nodes": NODES,
        "min-train-nodes": 1,  # round 2 goes on with node 0 alone (below it, a round stops the run)
        "num-server-rounds": 5,
        "round-timeout": timeout,
        "eval-every": 0,
        "results-dir": str(out),
    }
    run = subprocess.Popen(
        fed.run_command(config), env=fed.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for_rounds(run, out / "results.json", 1, timeout=300)
        network.set_link(netns.node(1), up=False)
        cut = time.monotonic()
        try:
            wait_for_rounds(run, out / "results.json", 2, timeout=120)
            round_two = time.monotonic() - cut
        finally:
            network.set_link(netns.node(1), up=True)
        output, _ = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 0, output[-3000:]
    results = json.loads((out / "results.json").read_text())
    failed = {f["round"] for f in results["failures"]}
    back = min((r for r in (3, 4, 5) if r not in failed), default=None)
    print(f"link down -> round 2 finished in {round_two:.1f} s; link up -> node back in round {back}")
    assert results["complete"] and [r["round"] for r in results["rounds"]] == [1, 2, 3, 4, 5]
    assert 2 in failed and failed <= {2, 3, 4} and all("partition-1" in f["node"] for f in results["failures"])
    assert all(f["reason"].startswith(f"no reply within {timeout:.0f} s") for f in results["failures"])
    assert round_two < timeout + 10 and results["rounds"][1]["exchanges"][0]["seconds"] < timeout + 2
    assert all(c["accuracy"] is not None for c in results["clients"])  # node 1 is back for the final evaluation


def listening_ports() -> set[int]:
    """TCP ports listening in the calling thread's namespace."""
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/thread-self/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                ports.add(int(fields[1].split(":")[1], 16))
    return ports


def reachable(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=3).close()
        return True
    except OSError:
        return False


def test_from_another_namespace_only_the_superlinks_fleet_port_answers(federation):
    """The exposure table of the README: every port any host listens on (the SuperLink's
    Control + Runtime API, each SuperNode's Runtime API) is unreachable from the others, but
    the Fleet port, whose TLS certificate names the SuperLink's address."""
    fed, network = federation, federation.network
    listening = {}
    for host in network.hosts:
        with network.inside(host):
            listening[host] = listening_ports()
    # No other listener: the Runtime API the ServerApp uses (ServerAppIo) is the Control port's.
    assert listening == {netns.SUPERLINK: {fed.fleet_port, fed.control_port}} | {
        netns.node(i): {fed.node_ports[i]} for i in range(NODES)
    }
    for client in network.hosts:
        with network.inside(client):
            answered = {
                (host, port)
                for host, ports in listening.items()
                if host != client
                for port in ports
                if reachable(network.address(host), port)
            }
            if client != netns.SUPERLINK:
                assert not reachable("127.0.0.1", fed.control_port)  # a loopback of its own, not the SuperLink's
        assert answered == ({(netns.SUPERLINK, fed.fleet_port)} if client != netns.SUPERLINK else set()), client
    context = ssl.create_default_context(cafile=fed.certs / "ca.crt")
    context.set_alpn_protocols(["h2"])
    with network.inside(netns.node(0)), socket.create_connection((fed.host, fed.fleet_port), timeout=10) as sock:
        with context.wrap_socket(sock, server_hostname=fed.host) as tls:  # verifies the SAN against the IP
            assert tls.selected_alpn_protocol() == "h2"


def test_ctrl_c_removes_every_namespace_link_and_process(usable, tmp_path):
    """`florist deploy-local --netns`, Ctrl-C'd once its SuperLink is up and its SuperNode starting."""
    tag, log, out = uuid.uuid4().hex, tmp_path / "output.txt", tmp_path / "out"
    command = [
        "deploy-local",
        "--netns",
        "--num-nodes",
        "1",
        "--rounds",
        "1",
        "--partition",
        "iid",
        "--results-dir",
        str(out),
        "--run-config",
        "unseen-fraction=0.0",
    ]
    with open(log, "w") as output:
        run = subprocess.Popen(
            [sys.executable, "-m", "florist", *command],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=os.environ | {"FLORIST_TEST_TAG": tag},
        )
    try:
        deadline = time.monotonic() + 120
        while not (out / "federation" / "logs" / "supernode-0.log").exists():
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        run.send_signal(signal.SIGINT)
        run.wait(timeout=30)
    finally:
        run.kill()
    assert run.returncode == 130, log.read_text()[-3000:]
    assert not [n for n in os.listdir(netns.NETNS_DIR) if n.startswith(f"fl{run.pid}-")]
    assert f"fl{run.pid}-" not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not marked("FLORIST_TEST_TAG", tag)


def ours(network: netns.Network) -> list[str]:
    """The namespaces of `network` that exist."""
    return [n for n in os.listdir(netns.NETNS_DIR) if n.startswith(f"{network.prefix}-")]


def test_leaving_a_network_removes_it_with_what_runs_inside(usable):
    network = netns.Network(["a", "b"])
    with pytest.raises(KeyboardInterrupt), network:
        assert len(ours(network)) == 3  # a, b and the switch
        sleeper = subprocess.Popen(network.command("a", ["sleep", "60"]))
        raise KeyboardInterrupt
    assert sleeper.wait(timeout=5) is not None and not ours(network)


@pytest.mark.parametrize("delay", [0.01, 0.05, 0.15])
def test_ctrl_c_while_a_network_is_made_leaves_nothing(usable, delay):
    """Whenever it lands: before, during or after the `ip` calls that make the network."""
    network, previous = netns.Network(["a", "b"]), signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
    try:
        with pytest.raises(KeyboardInterrupt):
            timer.start()
            with network:
                time.sleep(5)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert not ours(network)


def test_netns_without_root_is_refused_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    args = [
        "deploy-local",
        "--netns",
        "--num-nodes",
        "1",
        "--partition",
        "iid",
        "--results-dir",
        str(tmp_path),
        "--run-config",
        "unseen-fraction=0.0",
    ]
    assert main(args) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("florist: error: --netns needs ")
    assert not (tmp_path / "federation").exists()  # nothing was started
