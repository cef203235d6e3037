"""The suite's own plumbing (tests/conftest.py): the slow list names real tests, and a killed
run's temporary root is removed by the next run, never a live run's."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import LONGEST_QUICK, ROOT_PREFIX, SLOW, remove_stale_roots
from test_docs import RUNNABLE

REPO = Path(__file__).resolve().parents[1]


def test_every_slow_entry_names_a_test_file_or_a_docs_page_that_exists():
    """A renamed file, test or page would silently move its tests into `make test`'s quick set."""
    pages = {f"[{page.relative_to(REPO).as_posix()}]" for page in RUNNABLE}
    for entry in SLOW:
        path, _, test = entry.partition("::")
        assert (REPO / path).is_file(), f"SLOW names {path}, which does not exist"
        if "[" in test:
            assert test[test.index("[") :] in pages, f"SLOW names {entry}, a page test_docs.py does not run"
        elif test:
            assert f"def {test}(" in (REPO / path).read_text(), f"SLOW names {entry}, which {path} does not define"
    for path in LONGEST_QUICK:
        assert (REPO / path).is_file() and path not in SLOW, f"LONGEST_QUICK names {path}: gone, or slow"


def test_only_the_roots_of_runs_that_are_gone_are_removed(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{ROOT_PREFIX}{gone.pid}-abc"
    live = tmp_path / f"{ROOT_PREFIX}{os.getpid()}-def"
    unowned = tmp_path / f"{ROOT_PREFIX}x1y2z3"  # an older run's name without its pid: not ours to judge
    for folder in (dead, live, unowned):
        (folder / "flwr").mkdir(parents=True)
    assert remove_stale_roots(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and unowned.exists()
