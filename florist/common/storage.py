"""Files: atomic writes (a temporary file beside the target, renamed over it, so readers and
crashes never see half a file) and florist's cache folder."""

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


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/florist` (usually `~/.cache/florist`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "florist"


def open_log(path: Path, append: bool = False) -> IO[bytes]:
    """`path` opened for writing a log, never through a link: a link planted where the log goes
    is replaced by the log (O_NOFOLLOW: one planted between the two steps fails the open)."""
    if path.is_symlink():
        path.unlink()
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
    return os.fdopen(os.open(path, flags, 0o644), "ab" if append else "wb")
