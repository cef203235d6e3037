"""Test-wide environment: a private Flower home and cache, no telemetry, quiet Ray; which tests
are slow (`make test` leaves them out, `make test-all` runs them)."""

import os
import re
import shutil
import tempfile
from pathlib import Path

ROOT_PREFIX = "florist-tests-"


def remove_stale_roots(temp: Path) -> list[Path]:
    """Remove the roots that test runs killed before their end left in `temp` (their owner's pid
    is in the name and gone); another run's, still going, stays. Returns those removed."""
    removed = []
    for folder in temp.glob(f"{ROOT_PREFIX}*"):
        owner = re.match(rf"{ROOT_PREFIX}(\d+)-", folder.name)
        if owner and not _alive(int(owner.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


remove_stale_roots(Path(tempfile.gettempdir()))
_home = tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}-")
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

# The slow tests: real processes (SuperLinks, SuperNodes, docker, a box's install), Ray, the
# fuzzer, the docs' pages that deploy. `make test` leaves them out (`-m "not slow"`), so that a
# first run ends in minutes on 2 cores; `make test-all` (and CI) runs them too. A test not listed
# here is quick: list a new test that starts processes or Ray. An entry is a file or a test id.
# Longest first, as measured with two workers: pytest-xdist hands out whole files in this order
# (pyproject.toml's addopts), so the workers end together rather than one waiting out a long
# file alone; each file keeps its order.
SLOW = [
    "tests/runners/test_ray_cluster.py",
    "tests/test_docs.py::test_the_shell_blocks_of_a_page_run_twice_in_a_row[README.md]",
    "tests/test_docs.py::test_the_shell_blocks_of_a_page_run_twice_in_a_row[docs/using-models.md]",
    "tests/test_docs.py::test_the_shell_blocks_of_a_page_run_twice_in_a_row[docs/deployment.md]",
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
    "tests/deploy/test_docker.py",
    "tests/deploy/test_docker_superexec_auth.py",
    "tests/deploy/test_box_install.py",
    "tests/deploy/test_join_exposure.py",
    "tests/deploy/test_executor_identity.py",
    "tests/deploy/test_trusted_apps.py",
    "tests/deploy/test_bound_keys_deployed.py",
    "tests/deploy/test_reply_caps_deployed.py",
    "tests/deploy/test_secure_aggregation_deployed.py",
    "tests/deploy/test_superlink_guard.py",
    "tests/deploy/test_data_cache.py",
    "tests/deploy/test_join.py",
    "tests/runners/test_ray_loopback.py",
    "tests/client/test_server_to_node.py::test_the_users_own_simulation_still_reads_the_folder_dataset_it_names",  # Ray
    "tests/deploy/test_registration_flood.py",
]
# The quick files that take longest, longest first, for the same reason in `make test` (CPU
# seconds in one process, measured on 2 cores: test_docs.py's quick pages 113 come first above).
LONGEST_QUICK = [
    "tests/runners/test_presets.py",  # 127
    "tests/strategies/test_pefll.py",  # 47
    "tests/client/test_record_dp.py",  # 40
    "tests/runners/test_predict.py",  # 29
    "tests/test_determinism.py",  # 27
    "tests/test_cli.py",  # 22
    "tests/runners/test_compare_outputs.py",  # 18
    "tests/common/test_image_folders.py",  # 17
    "tests/test_flower_strategies.py",  # 17
]


def listed(nodeid: str, entries: list[str]) -> int | None:
    """The index of the first entry naming `nodeid` (its file or the test itself), else None."""
    return next((i for i, e in enumerate(entries) if nodeid == e or nodeid.startswith(e + "::")), None)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts processes or Ray, or takes minutes (tests/conftest.py's SLOW)")


def pytest_collection_modifyitems(items):
    order = [*SLOW, *LONGEST_QUICK]
    for item in items:
        if listed(item.nodeid, SLOW) is not None:
            item.add_marker(pytest.mark.slow)

    def rank(item) -> int:
        found = listed(item.nodeid.partition("::")[0], [e.partition("::")[0] for e in order])
        return len(order) if found is None else found

    items.sort(key=rank)


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
    before any work (no results.json: a run writes one before its first round, whatever the load;
    a wall-clock bound broke under load), exit 2, in one line (and the `--help` hint) holding
    `expected`, no traceback."""
    from florist.cli import main

    def check(argv: list[str], expected: str) -> None:
        code = main(["simulate", "--runtime", "in-process", *argv, "--results-dir", str(tmp_path / "r")])
        err = capsys.readouterr().err
        assert code == 2 and not (tmp_path / "r" / "results.json").exists(), err
        lines = err.strip().splitlines()
        assert len(lines) <= 2 and "Traceback" not in err and expected in lines[0], err

    return check
