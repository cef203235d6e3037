"""Stopping what florist started reaches every process below a marked one, including those
started with an environment of their own (as Ray's raylet starts its agents), and nothing else."""

import os
import signal
import subprocess
import sys
import uuid

from florist.common.processes import alive, descendants, terminate_marked

# A child that starts a grandchild without the marker (an empty environment), says its pid, and waits.
PARENT = """import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={})
print(grandchild.pid, flush=True)
time.sleep(60)
"""


def test_stopping_a_marked_process_stops_the_unmarked_processes_below_it():
    tag = uuid.uuid4().hex
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # ours, but not marked
    child = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=os.environ | {"FLORIST_TEST_TAG": tag}
    )
    try:
        grandchild = int(child.stdout.readline())
        assert descendants([child.pid]) == [grandchild]
        assert bystander.pid not in descendants([child.pid])
        terminate_marked("FLORIST_TEST_TAG", tag, grace=2.0)
        assert not alive(child.pid) and not alive(grandchild)
        assert alive(bystander.pid)
    finally:
        for process in (child, bystander):
            process.kill()
            process.wait()


def test_a_shell_that_exported_the_marker_is_not_stopped_nor_anything_below_it():
    """A user's shell with the same FLWR_HOME exported: `marked` skips the caller's ancestors, so
    neither the shell nor what is below it only through it (a job without the marker, the caller
    itself) is stopped."""
    tag = uuid.uuid4().hex
    caller = """import sys
from florist.common.processes import terminate_marked
terminate_marked("FLORIST_TEST_TAG", sys.argv[1], grace=2.0)
print("done", flush=True)
"""
    # The "shell": marked itself, it starts an unmarked job and then the caller, and says the job's pid.
    shell = f"""import subprocess, sys
job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={{}})
print(job.pid, flush=True)
print(subprocess.run([sys.executable, "-c", {caller!r}, {tag!r}], capture_output=True, text=True).stdout, flush=True)
"""
    run, job = (
        subprocess.Popen(
            [sys.executable, "-c", shell], stdout=subprocess.PIPE, text=True, env=os.environ | {"FLORIST_TEST_TAG": tag}
        ),
        None,
    )
    try:
        job = int(run.stdout.readline())
        assert run.stdout.readline().strip() == "done" and alive(job)
        assert run.wait(timeout=30) == 0
    finally:
        run.kill()
        run.wait()
        if job is not None and alive(job):
            os.kill(job, signal.SIGKILL)
