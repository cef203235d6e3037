"""Test-wide environment: a private Flower home and cache, no telemetry, quiet Ray."""

import os
import shutil
import tempfile

_home = tempfile.mkdtemp(prefix="florist-tests-")
os.environ.update(
    FLWR_HOME=os.path.join(_home, "flwr"),
    XDG_CACHE_HOME=os.path.join(_home, "cache"),
    FLWR_TELEMETRY_ENABLED="0",
    FLWR_DISABLE_UPDATE_CHECK="1",
    RAY_USAGE_STATS_ENABLED="0",
    RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0",
)


import pytest  # noqa: E402

import florist.apps.registry  # noqa: E402, F401  (hands config the strategies' sections, as every entry point does)

# The files that take longest (real processes, Ray, the fuzzer), longest first as measured with
# two workers. pytest-xdist hands out whole files in this order (pyproject.toml's addopts), so the
# workers end together rather than one waiting out a long file alone; each file keeps its order.
LONGEST = [
    "tests/runners/test_ray_cluster.py",
    "tests/test_docs.py",
    "tests/test_fuzz.py",
    "tests/test_adversarial.py",
    "tests/deploy/test_interrupt.py",
    "tests/deploy/test_executor.py",
    "tests/deploy/test_stock_flower.py",
    "tests/deploy/test_late_joiners.py",
    "tests/deploy/test_deployment.py",
    "tests/deploy/test_netns.py",
    "tests/test_simulation.py",
    "tests/deploy/test_superlink_crash.py",
    "tests/deploy/test_secure.py",
    "tests/deploy/test_superlink_memory.py",
    "tests/deploy/test_predict_deployed.py",
    "tests/deploy/test_nodes.py",
]


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(LONGEST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(LONGEST)))


def pytest_unconfigure(config):
    shutil.rmtree(_home, ignore_errors=True)  # every process the tests started has been stopped by now


@pytest.fixture
def all_settings() -> dict:
    """Every run-config key with its default: the common ones, then each strategy's once."""
    from florist.apps.registry import STRATEGIES
    from florist.config import RunConfig

    defaults = RunConfig().to_mapping()
    for spec in STRATEGIES.values():
        defaults |= {k: v for k, v in spec.settings().to_mapping().items() if k not in defaults}
    return defaults


@pytest.fixture
def make_node(tmp_path):
    """A client `Node` as a handler gets it, for calling an algorithm's client half directly:
    `make_node({"strategy": ...}, key=..., data=..., node_config=...)`."""
    from florist.client.node import Node
    from florist.client.state import NodeState
    from florist.common import scenarios
    from florist.config import RunConfig

    def make(values=None, key="partition-4", data=None, node_config=None, seen=True, run_id=1, server_round=1):
        node_config = dict(node_config or {})
        cfg = RunConfig.from_mapping(values or {})
        cfg = cfg.for_node(node_config)
        if data is None:
            data = scenarios.client_data(4, 5, cfg)
        state = NodeState(tmp_path / "state", key, cfg.strategy)
        return Node(key, seen, run_id, server_round, cfg, data, state, node_config, flower_run_id=run_id)

    return make


@pytest.fixture
def refuses_in_one_line(tmp_path, capsys):
    """`refuses_in_one_line(argv, expected)`: `florist simulate --runtime in-process ARGV` stops
    within 5 s, exit 2, in one line (and the `--help` hint) holding `expected`, no traceback."""
    import time

    from florist.cli import main

    def check(argv: list[str], expected: str) -> None:
        began = time.monotonic()
        code = main(["simulate", "--runtime", "in-process", *argv, "--results-dir", str(tmp_path / "r")])
        err = capsys.readouterr().err
        assert code == 2 and time.monotonic() - began < 5, err
        lines = err.strip().splitlines()
        assert len(lines) <= 2 and "Traceback" not in err and expected in lines[0], err

    return check
