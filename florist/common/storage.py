"""Files: atomic writes (a temporary file beside the target, renamed over it, so readers and
crashes never see half a file) and florist's cache folder."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def atomic_write(path: Path, writer: Callable[[IO[bytes]], object], shared: bool = False) -> Path:
    """`writer`'s bytes as `path`, whole or not at all. The file is private (0600, as the
    temporary file it was) unless `shared`: then it has any new file's mode (0666 less the umask),
    for what a user writes to hand on (an export, predictions)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        try:
            writer(tmp)
            if shared:
                umask = os.umask(0)
                os.umask(umask)
                os.fchmod(tmp.fileno(), 0o666 & ~umask)
        except BaseException:  # a Ctrl-C or a failed write: the old file stays, and no half-written copy beside it
            os.unlink(tmp.name)
            raise
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
