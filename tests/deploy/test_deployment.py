"""Real processes: a SuperLink and SuperNodes on 127.0.0.1 talking over the gRPC Fleet API.

Every process is started by the test's LocalFederation and stopped by PID; every wait is bounded.
"""

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from florist.cli import main
from florist.common.data import load_digits
from florist.common.knn import LAMBDA_GRID
from florist.common.models import build_model
from florist.deploy.certs import make_ca_and_server, make_node_key
from florist.deploy.federation import LocalFederation, free_port, started_with
from florist.deploy.join import JoinError, join

RUN = {"strategy": "fedavg", "partition": "iid", "local-epochs": 2, "unseen-fraction": 0.0, "round-timeout": 120.0}


def node_configs(n: int, root: Path) -> list[dict]:
    return [{"partition-id": i, "num-partitions": n, "state-dir": str(root / "state")} for i in range(n)]


def connected_pids(port: int) -> set[int]:
    """PIDs holding an ESTABLISHED TCP connection to local `port` (read from /proc; gRPC uses
    IPv4-mapped IPv6 sockets, so both tables count)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[2].split(":")[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                pids.add(int(pid))
        except OSError:
            continue
    return pids


def submit(fed: LocalFederation, results: Path, **overrides) -> dict:
    config = RUN | {"min-nodes": len(fed.nodes), "results-dir": str(results)} | overrides
    done = subprocess.run(fed.run_command(config), env=fed.env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((results / "results.json").read_text())


def wait_for_rounds(run: subprocess.Popen, progress: Path, rounds: int, timeout: float) -> None:
    """Until the run's checkpointed results.json lists `rounds` rounds; fails if the run ends first."""
    deadline = time.monotonic() + timeout
    while not (progress.exists() and len(json.loads(progress.read_text())["rounds"]) >= rounds):
        assert run.poll() is None, run.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"fewer than {rounds} rounds after {timeout:.0f} s"
        time.sleep(0.5)


def labelled_folder(path: Path) -> Path:
    rng = np.random.default_rng(0)
    path.mkdir(parents=True)
    for split in ("train", "test"):
        np.savez(path / f"{split}.npz", x=rng.random((20, 1, 8, 8), dtype=np.float32), y=rng.integers(0, 10, 20))
    return path


@pytest.mark.parametrize("executor", ["warm", "flower"])
def test_deploy_local_runs_fedavg_over_grpc(tmp_path, executor):
    rounds = 2 if executor == "warm" else 1  # Flower's own executor takes ~20 s per exchange
    args = ["deploy-local", "--strategy", "fedavg", "--num-nodes", "3", "--rounds", str(rounds), "--partition", "iid",
            "--results-dir", str(tmp_path / "out"), "--run-config", "unseen-fraction=0.0 local-epochs=2",
            "--executor", executor]  # fmt: skip
    assert main(args) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["complete"] and len(results["rounds"]) == rounds and not results["failures"]
    assert results["summary"]["seen"]["num_clients"] == 3
    assert results["summary"]["seen"]["mean_accuracy"] > 0.3  # chance is 0.1
    logs = tmp_path / "out" / "federation" / "logs"
    superlink_log = (logs / "superlink.log").read_text()
    assert "Starting Fleet API (gRPC-rere)" in superlink_log
    assert superlink_log.count("[Fleet.ActivateNode]") >= 3
    node_log = (logs / "supernode-0.log").read_text()
    if executor == "warm":  # after the first message of a new app bundle, florist's ClientApp runs warm
        assert node_log.count(": warm process") >= 4 and ": stock process" not in node_log.split(": warm process")[-1]
    else:
        assert "florist.executor" not in node_log and "Start `flwr-clientapp` process" in node_log
    assert not started_with(tmp_path / "out" / "federation" / "flwr-home")  # every process it started is gone


@pytest.fixture(scope="module")
def secure_federation(tmp_path_factory):
    root = tmp_path_factory.mktemp("tls")
    with LocalFederation(root, node_configs(3, root), tls=True, auth=True) as fed:
        yield fed


def test_tls_auth_federation_trains_over_the_fleet_connection(secure_federation, tmp_path):
    fed = secure_federation
    on_fleet = connected_pids(fed.fleet_port)
    assert all(node.pid in on_fleet for node in fed.nodes)  # each SuperNode holds a gRPC connection to the Fleet port
    results = submit(fed, tmp_path / "out", **{"num-server-rounds": 1})
    assert results["complete"] and results["summary"]["seen"]["num_clients"] == 3


def test_unregistered_key_is_refused_clearly(secure_federation, tmp_path):
    stranger, _ = make_node_key(tmp_path, "stranger")
    with pytest.raises(JoinError, match="not registered.*flwr supernode register"):
        join(secure_federation.fleet_address, labelled_folder(tmp_path / "data"),
             root_certificates=secure_federation.certs / "ca.crt", auth_key=stranger, max_wait_time=20)  # fmt: skip


def test_node_without_the_right_ca_cannot_connect(secure_federation, tmp_path):
    other_ca = make_ca_and_server(tmp_path / "other", ["localhost"])["ca"]
    with pytest.raises(JoinError, match="does not verify"):
        join(secure_federation.fleet_address, labelled_folder(tmp_path / "data"), root_certificates=other_ca,
             auth_key=secure_federation.node_key(0)[0], max_wait_time=20)  # fmt: skip


def test_unreachable_superlink_gives_up_with_a_clear_error(tmp_path):
    start = time.monotonic()
    with pytest.raises(JoinError, match="cannot reach the SuperLink"):
        join(f"127.0.0.1:{free_port()}", labelled_folder(tmp_path / "data"), max_wait_time=5)
    assert time.monotonic() - start < 60


def test_join_checks_the_data_folder_before_connecting(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        join("127.0.0.1:9092", tmp_path / "missing")


def test_superlink_restart_keeps_nodes_and_the_next_run_works(tmp_path):
    with LocalFederation(tmp_path, node_configs(2, tmp_path), persistent=True) as fed:
        before = sorted(n["node-id"] for n in fed.online_nodes())
        fed.superlink.stop()
        fed.start_superlink()
        fed.wait_for_nodes(2, timeout=180)
        assert sorted(n["node-id"] for n in fed.online_nodes()) == before
        results = submit(fed, tmp_path / "out", **{"num-server-rounds": 1})
        assert results["complete"] and results["summary"]["seen"]["num_clients"] == 2


def test_a_supernode_killed_mid_run_is_left_out(tmp_path):
    with LocalFederation(tmp_path, node_configs(3, tmp_path)) as fed:
        config = RUN | {"min-nodes": 3, "num-server-rounds": 2, "round-timeout": 45.0, "results-dir": str(tmp_path / "out")}
        run = subprocess.Popen(fed.run_command(config), env=fed.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        progress = tmp_path / "out" / "results.json"
        wait_for_rounds(run, progress, 1, timeout=300)
        os.kill(fed.nodes[2].pid, signal.SIGKILL)
        output, _ = run.communicate(timeout=600)
        assert run.returncode == 0, output[-3000:]
        results = json.loads(progress.read_text())
        assert results["complete"] and len(results["rounds"]) == 2
        assert results["failures"] and all("partition-2" in f["node"] for f in results["failures"])
        assert "partition-2" in output  # the server log names the node that failed
        scored = {c["client"]: c["accuracy"] for c in results["clients"]}
        assert scored["partition-2"] is None and scored["partition-0"] is not None and scored["partition-1"] is not None


def run_with_late_joiner(tmp_path: Path, late: dict | None = None, **overrides) -> dict:
    """Train with 3 SuperNodes, then start a 4th one (node config `late`, else partition 3);
    the server serves it before finishing."""
    configs = node_configs(4, tmp_path)
    fed = LocalFederation(tmp_path, configs[:3] + [late or configs[3]])
    try:
        fed.start(num_started=3)
        config = RUN | {"min-nodes": 3, "serve-seconds": 240.0, "serve-count": 1, "results-dir": str(tmp_path / "out")}
        config |= overrides
        run = subprocess.Popen(fed.run_command(config), env=fed.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        progress = tmp_path / "out" / "results.json"
        wait_for_rounds(run, progress, config["num-server-rounds"], timeout=400)  # training done
        fed.start_node(3)  # the late joiner
        output, _ = run.communicate(timeout=600)
        assert run.returncode == 0, output[-3000:]
    finally:
        fed.stop()
    results = json.loads(progress.read_text())
    assert results["summary"]["seen"]["num_clients"] == 3
    [joined] = [c for c in results["clients"] if not c["seen"]]  # joined after training: unseen
    assert joined["client"] == (late or {}).get("node-key", "partition-3")
    return results


def test_knnper_personalizes_a_node_that_joins_after_training(tmp_path):
    results = run_with_late_joiner(tmp_path, strategy="knnper", partition="pathological:2", **{"num-server-rounds": 2})
    [late] = [c for c in results["clients"] if c["client"] == "partition-3"]
    assert results["summary"]["unseen"]["num_clients"] == 1  # scored
    assert late["datastore_size"] == late["num_train"] and late["lambda"] in LAMBDA_GRID
    assert (tmp_path / "state" / "partition-3" / "datastore.npz").exists()  # persisted in its state folder


def test_pefll_trains_in_three_exchanges_and_predicts_a_model_for_a_late_joiner(tmp_path):
    results = run_with_late_joiner(tmp_path, strategy="pefll", **{"num-server-rounds": 1, "hn-local-steps": 10})
    assert not results["failures"] and math.isfinite(results["rounds"][0]["train_loss"])
    assert all(c["accuracy"] is not None for c in results["clients"])  # PeFLL-predict for all four


def test_odpfl_serves_a_late_node_that_has_no_labels(tmp_path):
    folder = tmp_path / "newcomer"
    folder.mkdir()
    x, _ = load_digits()
    np.savez(folder / "train.npz", x=x[:80])  # no y anywhere: nothing to train or score with
    np.savez(folder / "test.npz", x=x[80:100])
    late = {"data-dir": str(folder), "node-key": "newcomer", "state-dir": str(tmp_path / "state"), "dp-epsilon": 3.0}
    results = run_with_late_joiner(tmp_path, late, strategy="odpfl", partition="pathological:2",
                                   **{"num-server-rounds": 1, "hn-local-steps": 10})  # fmt: skip
    [newcomer] = [c for c in results["clients"] if c["client"] == "newcomer"]
    assert newcomer["accuracy"] is None and newcomer["dp_epsilon"] == 3.0 and newcomer["dp_sigma"] > 0
    assert newcomer["descriptor_size"] == newcomer["num_train"]
    saved = np.load(tmp_path / "state" / "newcomer" / "generated-model.npz")  # the node keeps its model
    assert set(saved.files) == set(build_model("cnn", (1, 8, 8), 10).state_dict())
    assert not [f for f in results["failures"] if f["node"].endswith("(newcomer)")]


def test_perfed_ckt_nodes_with_three_architectures_share_only_soft_decisions(tmp_path):
    late = node_configs(4, tmp_path)[3] | {"model": "mlp"}  # node config wins over client-models
    results = run_with_late_joiner(tmp_path, late, strategy="perfed-ckt", **{
        "num-server-rounds": 2, "eval-every": 0, "client-models": "cnn,mlp,cnn-wide"})  # fmt: skip
    clients = {c["client"]: c for c in results["clients"]}
    assert not results["failures"] and all(c["accuracy"] is not None for c in clients.values())
    assert len({clients[f"partition-{i}"]["num_params"] for i in range(3)}) == 3
    assert clients["partition-3"]["num_params"] == clients["partition-1"]["num_params"]  # both mlp
    assert clients["partition-3"]["rounds_trained"] == 0 and clients["partition-3"]["cluster"] >= 0
    for i in range(4):  # every node keeps its own model in its state folder
        assert (tmp_path / "state" / f"partition-{i}" / "perfed-ckt-model.npz").exists()
    assert all(r["fedavg_bytes_up"] > 5 * r["train_bytes_up"] for r in results["rounds"])


def test_fedattn_personalizes_a_late_joiner_from_its_nearest_clients(tmp_path):
    results = run_with_late_joiner(tmp_path, strategy="fedattn", **{
        "num-server-rounds": 2, "eval-every": 0, "fedattn-warmup": 1, "fedattn-k": 2})  # fmt: skip
    clients = {c["client"]: c for c in results["clients"]}
    assert not results["failures"] and all(c["accuracy"] is not None for c in clients.values())
    assert clients["partition-3"]["neighbours"] == 2 and 0.5 <= clients["partition-3"]["attention_max"] <= 1
    for i in range(3):  # trained nodes keep Z_i and M_i in their state folder
        assert set(np.load(tmp_path / "state" / f"partition-{i}" / "fedattn.npz").files) == {"z", "m"}
