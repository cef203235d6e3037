"""`florist simulate --ray-address` on a two-node Ray cluster made here: the head and a worker,
each started by `ray start` in a network namespace of its own, with its own address on a
private bridge (`florist.deploy.netns`, the `--netns` machinery), and each node's processes in
PID and mount namespaces of their own: killing its `unshare` ends every one of them. The driver
runs on the head, as the README says, and every node has a data cache of its own, as separate
machines would. Runs (`simulate`, and `compare`'s) match the same runs in-process (which match
a local simulation to the last digit: tests/test_simulation.py) with clients on both nodes; a
dataset folder that a node cannot read is refused before the run starts; Ctrl-C stops the
run's driver and actors, not the cluster.

Where network namespaces cannot be made (not root), the two nodes are two raylets on the
loopback of one private network namespace (a user namespace's, which needs no root), as Ray's
own multi-node tests on one machine share one address; FLORIST_TEST_RAY_ON_LOOPBACK=1 asks for
that here. Everything is made by the test and removed, which the fixture asserts at the end;
every wait is bounded.
"""

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord
from PIL import Image

from florist.cli import main
from florist.common import data as data_lib
from florist.common import protocol
from florist.common.processes import alive, descendants, marked
from florist.config import RunConfig
from florist.deploy import netns
from florist.runners import raycluster
from florist.runners.inprocess import run_in_process
from florist.runners.simulation import client_resources
from florist.server.strategy import TESTED

HEAD, WORKER = "ray-head", "ray-worker"
REPO = Path(__file__).parents[2]
RUN = {"num-clients": 4, "partition": "iid", "rounds": 2, "cpus-per-client": 1}  # and seed 2
WAIT = 480.0  # seconds: the most any start, run or stop below may take on a 2-core machine with two CPU hogs beside
HEAD_PORT = 6379  # the head's GCS; every other port of a node is next to it (`_ray_start`)
PORTS = (
    "node-manager",
    "object-manager",
    "runtime-env-agent",
    "dashboard-agent-grpc",
    "dashboard-agent-listen",
    "metrics-export",
)
SERVERS = ("raylet", "gcs_server")  # a cluster's own processes, which no run may stop
ACTOR = "ray::ClientAppActor"  # the command line of a Ray worker that holds one of Flower's client actors


@dataclasses.dataclass
class Node:
    ip: str
    unshare: subprocess.Popen  # every process of the node is below it, in the PID namespace of its child
    log: Path

    def running(self, prefix: str = "") -> list[int]:
        """The node's live processes whose command line starts with `prefix`."""
        return [p for p in descendants([self.unshare.pid]) if _cmdline(p).startswith(prefix) and alive(p)]


@dataclasses.dataclass
class Hosts:
    """Where the nodes run: each in a network namespace of its own (`network`), or both on the
    loopback of one private namespace that the `holder` process keeps."""

    network: netns.Network | None = None
    holder: subprocess.Popen | None = None

    def ip(self, host: str) -> str:
        return self.network.address(host) if self.network else "127.0.0.1"

    def command(self, host: str, args: list[str]) -> list[str]:
        if self.network:
            return self.network.command(host, args)
        return ["nsenter", "--target", str(self.holder.pid), "--user", "--net", "--preserve-credentials", *args]


@dataclasses.dataclass
class Cluster:
    root: Path
    tag: str  # in the environment of every process the test starts
    hosts: Hosts
    nodes: list[Node] = dataclasses.field(default_factory=list)
    address: str = ""

    def env(self, role: str) -> dict[str, str]:
        """The environment of a node's or the driver's processes, with a data cache of its own."""
        env = {k: v for k, v in os.environ.items() if k != raycluster.ADDRESS_ENV}
        return env | {"XDG_CACHE_HOME": str(self.root / f"cache-{role}"), "FLORIST_TEST_TAG": self.tag}

    def florist(self, command: str, **options) -> subprocess.Popen:
        """`florist COMMAND --ray-address` on the head (`options` over `RUN`), its output piped."""
        flags = [f"--{name}={value}" for name, value in (RUN | options).items()]
        return subprocess.Popen(
            self.hosts.command(
                HEAD, [sys.executable, "-m", "florist", command, f"--ray-address={self.address}", *flags]
            ),
            cwd=REPO,
            env=self.env("driver"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def start(self, host: str, hidden: Path) -> Node:
        """`ray start` of the head (the first) or of a worker joining it, in PID and mount
        namespaces of its own; a worker sees a tmpfs over `hidden`."""
        ip, log = self.hosts.ip(host), self.root / f"{host}.log"
        hide = 'mount -t tmpfs tmpfs "$0" && ' if self.nodes else ""
        isolated = ["unshare", "--fork", "--pid", "--mount-proc", "--kill-child", "sh", "-c", hide + 'exec "$@"']
        args = _ray_start(len(self.nodes), ip, self.root / host, self.address or None)
        with open(log, "w") as out:
            command = self.hosts.command(host, [*isolated, str(hidden), *args])
            process = subprocess.Popen(command, env=self.env(host), stdout=out, stderr=subprocess.STDOUT)
        self.nodes.append(node := Node(ip, process, log))
        _wait(lambda: "Ray runtime started" in log.read_text(), f"`ray start` of {host}", node)
        self.address = self.address or f"{ip}:{HEAD_PORT}"
        return node


def _ray_start(i: int, ip: str, temp: Path, head: str | None) -> list[str]:
    """`ray start --block` of node `i` at `ip` with one CPU, its temporary folder `temp`, and
    ports of its own, which two nodes on one address need: the head when `head` is None, else a
    worker joining it."""
    args = [str(Path(sys.executable).parent / "ray"), "start", "--block", f"--node-ip-address={ip}", "--num-cpus=1"]
    args += ["--num-gpus=0", "--disable-usage-stats", f"--object-store-memory={80 * 2**20}", f"--temp-dir={temp}"]
    base = HEAD_PORT + 1 + 100 * i
    args += [f"--{part}-port={base + k}" for k, part in enumerate(PORTS)]
    args += [f"--min-worker-port={base + 50}", f"--max-worker-port={base + 99}"]
    return args + (
        ["--head", f"--port={HEAD_PORT}", "--include-dashboard=false"] if head is None else [f"--address={head}"]
    )


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _wait(condition, what: str, node: Node | None = None) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        log = node.log.read_text()[-3000:] if node else ""
        assert node is None or node.unshare.poll() is None, f"{what}: the node exited: {log}"
        assert time.monotonic() < deadline, f"{what}: not within {WAIT:.0f} s {log}"
        time.sleep(0.2)


@contextlib.contextmanager
def _hosts(loopback: bool) -> Iterator[Hosts]:
    """Network namespaces of their own for the nodes or, with `loopback`, one for both."""
    if not loopback:
        with netns.Network([HEAD, WORKER]) as network:
            yield Hosts(network=network)
        return
    user = ["--user", "--map-root-user"]  # a network namespace without root: its user namespace's
    holder = subprocess.Popen(
        ["unshare", *user, "--net", "--kill-child", "sh", "-c", "ip link set lo up && exec sleep 3600"]
    )
    try:
        yield Hosts(holder=holder)
    finally:
        holder.kill()
        holder.wait(timeout=30)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """The two-node cluster the tests share, with a dataset folder every node has (`root/data`)
    and one the worker does not see (`root/hidden`). At the end nothing of it is left."""
    loopback = os.environ.get("FLORIST_TEST_RAY_ON_LOOPBACK") == "1" or netns.probe() is not None
    root = Path(tempfile.mkdtemp(prefix="frc", dir="/tmp"))  # short: Ray's socket paths must fit 107 characters
    tag = uuid.uuid4().hex
    _digits_folder(root / "data" / "digits")
    _digits_folder(root / "hidden" / "digits")
    try:
        with _hosts(loopback) as hosts:
            cluster = Cluster(root, tag, hosts)
            try:
                cluster.start(HEAD, root / "hidden")
                cluster.start(WORKER, root / "hidden")
                yield cluster
            finally:
                for node in cluster.nodes:
                    node.unshare.kill()  # its forked child, init of the node's PID namespace, dies: all go
                    node.unshare.wait(timeout=30)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert not [p for p in marked("FLORIST_TEST_TAG", tag) if alive(p)]
    if hosts.network:
        prefix = hosts.network.prefix
        assert not [n for n in os.listdir(netns.NETNS_DIR) if n.startswith(f"{prefix}-")]
        assert prefix not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def _digits_folder(path: Path, count: int = 240) -> Path:
    """`count` digits as 8×8 PNGs, one subfolder per class: a dataset folder as users keep them."""
    x, y = data_lib.load_digits()
    for i, (image, label) in enumerate(zip(x[:count], y[:count])):
        (path / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray((image[0] * 255).astype(np.uint8)).save(path / str(label) / f"{i}.png")
    return path


def _finish(run: subprocess.Popen) -> tuple[str, str]:
    """The run's output once it has ended (killed if it has not within `WAIT`)."""
    try:
        return run.communicate(timeout=WAIT)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()


def test_ctrl_c_stops_the_runs_driver_and_actors_but_not_the_cluster(cluster, tmp_path):
    servers = [p for n in cluster.nodes for p in n.running() if Path(_cmdline(p).split()[0]).name in SERVERS]
    assert len(servers) == 3  # a raylet on each node, the head's GCS
    run = cluster.florist("simulate", rounds=200, seed=2, **{"results-dir": tmp_path / "out"})
    _wait(lambda: run.poll() is not None or all(n.running(ACTOR) for n in cluster.nodes), "actors on both nodes")
    if run.poll() is None:  # else it failed: its output says why
        run.send_signal(signal.SIGINT)
    _, err = _finish(run)
    assert run.returncode == 130 and err.strip().splitlines()[-1].startswith("florist: interrupted after"), err[-3000:]
    _wait(lambda: not any(n.running(ACTOR) for n in cluster.nodes), "the run's actors gone")
    assert all(alive(p) for p in servers)


RUNS = {  # `florist compare` too: it takes the address through to every run
    "simulate-fedavg-on-a-folder-every-node-has": ("fedavg", "data/digits"),
    "compare-knnper-on-embedded-digits": ("knnper", "digits"),
}


@pytest.mark.parametrize("name", RUNS)
def test_a_run_on_the_cluster_uses_both_nodes_and_matches_the_same_run_here(cluster, name, tmp_path):
    strategy, dataset = RUNS[name]
    dataset = str(cluster.root / dataset) if "/" in dataset else dataset
    if name.startswith("simulate"):
        run = cluster.florist("simulate", strategy=strategy, dataset=dataset, seed=2, **{"results-dir": tmp_path / "a"})
    else:
        run = cluster.florist("compare", strategies=strategy, dataset=dataset, seeds=2, out=tmp_path / "b")
    out, err = _finish(run)
    assert run.returncode == 0, (out + err)[-3000:]
    [found] = tmp_path.glob("**/results.json")
    results = json.loads(found.read_text())
    config = {"strategy": strategy, "dataset": dataset, "partition": "iid", "seed": 2, "num-server-rounds": 2}
    reference = run_in_process(RunConfig.from_mapping(config | {"min-nodes": 4, "results-dir": str(tmp_path / "c")}), 4)
    scores = lambda r: {c["client"]: c["accuracy"] for c in r["clients"]}  # noqa: E731
    assert scores(results) == scores(reference) and None not in scores(results).values() and len(scores(results)) == 4
    assert [r["train_loss"] for r in results["rounds"]] == [r["train_loss"] for r in reference["rounds"]]
    print({c["client"]: (c["ray_node_ip"], c["ray_node"][:8]) for c in results["clients"]})
    assert len({c["ray_node"] for c in results["clients"]}) == 2  # each final evaluation ran on one node: both had some
    if cluster.hosts.network:
        assert {c["ray_node_ip"] for c in results["clients"]} == {n.ip for n in cluster.nodes}
    assert not any("ray_node" in c for c in reference["clients"])  # no Ray, no place


def test_a_folder_a_node_cannot_read_is_refused_before_the_run_in_one_line(cluster, tmp_path):
    folder = cluster.root / "hidden" / "digits"  # the worker node has a tmpfs over hidden/
    run = cluster.florist("simulate", dataset=folder, seed=2, **{"results-dir": tmp_path / "out"})
    _, err = _finish(run)
    [line] = [line for line in err.splitlines() if line.startswith("florist: error:")]
    assert run.returncode == 2 and line == err.strip().splitlines()[-1], err[-3000:]
    worker = cluster.nodes[1].ip if cluster.hosts.network else ""
    assert f"dataset folder {folder} cannot be used on Ray node {worker}" in line, line
    assert "No such file or directory" in line and not (tmp_path / "out" / "checkpoint.pt").exists()


def test_cluster_mistakes_are_refused_at_once_in_one_line(capsys, monkeypatch, tmp_path):
    """No cluster needed: a wrong form, no head at the address, and the in-process runtime."""
    for command in (["simulate", "--results-dir", str(tmp_path)], ["compare", "--out", str(tmp_path)]):
        for flags, expected in [
            (["--ray-address", "head"], "--ray-address 'head' is not HOST:PORT"),
            (["--ray-address", "127.0.0.1:1"], "no Ray cluster answers at 127.0.0.1:1 (Connection refused)"),
            (["--ray-address", "127.0.0.1:1", "--runtime", "in-process"], "--ray-address needs --runtime simulation"),
        ]:
            assert main(command + ["--rounds", "1"] + flags) == 2
            [line] = capsys.readouterr().err.strip().splitlines()
            assert line.startswith(f"florist: error: {expected}"), line
    monkeypatch.setenv(raycluster.ADDRESS_ENV, "127.0.0.1:1")
    assert raycluster.address_of(None, "in-process") is None  # the variable is for runs with Ray
    assert raycluster.address_of("", "simulation") is None  # an empty flag asks for a local Ray
    with pytest.raises(ValueError, match="no Ray cluster answers at 127.0.0.1:1"):
        raycluster.address_of(None, "simulation")


def _node(ip: str, cpus: float, gpus: float = 0) -> dict:
    """A live node as `ray.nodes()` lists it (the fields `fit` reads)."""
    resources = {"CPU": cpus, "memory": 2e9} | ({"GPU": gpus} if gpus else {})
    return {"NodeID": ip, "NodeManagerAddress": ip, "Alive": True, "Resources": resources}


def test_client_resources_are_fitted_to_the_clusters_nodes_not_this_machines():
    many = 2 * (os.cpu_count() or 1)
    with pytest.raises(ValueError, match="this machine's cores"):
        client_resources(many)
    assert client_resources(many, cluster=True) == {"num_cpus": many, "num_gpus": None}  # fitted once connected
    nodes = [_node("10.0.0.1", 2), _node("10.0.0.2", 8, gpus=2)]
    assert raycluster.fit({"num_cpus": 8, "num_gpus": None}, nodes, "h:1") == {"num_cpus": 8.0, "num_gpus": 0.25}
    assert raycluster.fit({"num_cpus": 1, "num_gpus": None}, nodes[:1], "h:1") == {"num_cpus": 1.0, "num_gpus": 0.0}
    with pytest.raises(
        ValueError, match=r"can give a client 4 CPU\(s\) and 1 GPU\(s\) .*10\.0\.0\.1: 2 CPU\(s\), 0 GPU\(s\); 10"
    ):
        raycluster.fit({"num_cpus": 4, "num_gpus": 1}, [nodes[0], _node("10.0.0.2", 2, gpus=2)], "h:1")


def test_a_folder_listing_is_the_same_on_a_copy_and_names_what_differs(tmp_path):
    """What every node computes of a dataset folder: names and sizes, not modification times,
    which a copy to another machine changes."""
    original = _digits_folder(tmp_path / "a", count=20)
    copy = shutil.copytree(original, tmp_path / "b", copy_function=shutil.copy)  # new modification times
    assert raycluster.listing([str(original)]) == raycluster.listing([str(copy)])
    next(copy.rglob("*.png")).write_bytes(b"")
    [(files, _)] = raycluster.listing([str(copy)])
    assert files == 20 and raycluster.listing([str(copy)]) != raycluster.listing([str(original)])
    [reason] = raycluster.listing([str(tmp_path / "missing")])
    assert reason.startswith("No such file or directory on host ")


def test_where_a_reply_ran_reaches_the_results_only_in_its_own_form():
    """A reply's place (`ray_node`, `ray_node_ip`, `host`) is text a node writes into results.json:
    anything else there, or of another form, makes the reply ill-formed."""
    content = protocol.content(metrics={"accuracy": 0.5, "num-examples": 3})
    place = {"ray-node": "3adfbfb2", "ray-node-ip": "10.213.0.2", "host": "gpu-7.lab"}
    content[protocol.PLACE] = ConfigRecord(place)
    assert protocol.metrics_of(content, TESTED, "node 1") == {"accuracy": 0.5, "num-examples": 3} | place
    for wrong in ({"ray-node": "../../etc"}, {"host": "a\nb"}, {"where": "here"}, {"ray-node": 5}):
        content[protocol.PLACE] = ConfigRecord(wrong)
        with pytest.raises(protocol.ProtocolError, match="node 1: place"):
            protocol.metrics_of(content, TESTED, "node 1")
