"""Where a client computes: the `device` setting, a node's override, torch's thread count."""

import pytest
import torch

from florist.apps.client import build_client_app
from florist.common import devices
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process

RUN = {"num-server-rounds": 2, "min-nodes": 3, "partition": "iid", "unseen-fraction": 0.0, "eval-every": 1}


def _accuracies(results):
    return [(c["client"], c["accuracy"]) for c in results["clients"]]


def test_device_cpu_and_auto_give_identical_results_on_a_machine_without_gpu(tmp_path):
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("auto picks the GPU on this machine; the test is for one without")
    runs = [
        run_in_process(RunConfig.from_mapping(RUN | {"device": d, "results-dir": str(tmp_path / d)}), 3)
        for d in ("cpu", "auto")
    ]
    assert _accuracies(runs[0]) == _accuracies(runs[1]) and all(a is not None for _, a in _accuracies(runs[0]))


def test_a_device_is_checked_by_form_at_once_and_by_presence_on_the_machine():
    with pytest.raises(ValueError, match="device must be 'auto'"):
        RunConfig.from_mapping({"device": "gpu"})
    assert devices.resolve("cpu").type == "cpu" and devices.resolve("auto").type in ("cpu", "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device 'cuda:1' is not available on this machine \(available: cpu"):
            devices.resolve("cuda:1")


def test_torch_threads_follow_the_node_config_and_the_clients_cpus(tmp_path):
    seen = {}

    def record(msg, context, call_next):
        reply = call_next(msg, context)  # the handler sets the count before it works
        seen.setdefault(context.node_config["partition-id"], set()).add(torch.get_num_threads())
        return reply

    before = torch.get_num_threads()
    app = build_client_app(mods=[record])
    nodes = [{"partition-id": i, "num-partitions": 3} | ({"torch-threads": 2} if i == 1 else {}) for i in range(3)]
    from florist.runners import inprocess

    grid = inprocess.InProcessGrid(app, nodes, cpus_per_client=1)
    cfg = RunConfig.from_mapping(RUN | {"results-dir": str(tmp_path)})
    with inprocess.server_identity(grid.run_id):
        from florist.apps.server import run

        run(grid, cfg, None, grid.run_id)
    assert seen == {0: {1}, 1: {2}, 2: {1}}  # the node's own count wins over the client's CPUs
    torch.set_num_threads(before)
