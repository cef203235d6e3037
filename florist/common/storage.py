"""Atomic file writes: write to a temporary file beside the target, then rename over it, so
readers (and a crash) never see half a file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def atomic_write(path: Path, writer: Callable[[IO[bytes]], object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        writer(tmp)
    os.replace(tmp.name, path)
    return path
