"""The benchmarks' work folder: removed when a benchmark ends, whether it finished or was stopped
with Ctrl-C, so that repeated runs do not fill the disk (a deployed benchmark leaves ~170 MB of
state, logs and results a run); kept, and named, when the benchmark fails, for its logs."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def work_folder(prefix: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except KeyboardInterrupt:
        shutil.rmtree(path, ignore_errors=True)
        raise
    except (Exception, SystemExit) as err:
        if not isinstance(err, SystemExit) or err.code not in (None, 0):
            print(f"work folder kept for its logs: {path}", file=sys.stderr)
            raise
    shutil.rmtree(path, ignore_errors=True)
