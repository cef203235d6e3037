"""A joining node's log starts with what its user can act on: not which faiss build this CPU
loads (each one tried printed a ModuleNotFoundError), nor alembic's or matplotlib's start-up."""

import subprocess
import sys


def test_the_executors_logging_drops_library_start_up_chatter(tmp_path):
    code = (
        "from florist.deploy.executor import configure_logging; configure_logging(); "
        "import logging, faiss, matplotlib.pyplot; from flwr.supercore.state.alembic import utils; "
        "logging.getLogger('florist.executor').info('preloaded')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={"XDG_CACHE_HOME": str(tmp_path)}
    )
    assert done.returncode == 0, done.stderr
    assert "INFO florist.executor: preloaded" in done.stderr  # florist's own lines still show
    for noise in ("faiss.loader", "ModuleNotFoundError", "alembic", "fontManager"):
        assert noise not in done.stderr, done.stderr
