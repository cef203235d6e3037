"""The app bundle `flwr run` submits: florist's publishable files, staged from the checkout."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from florist.common import flower_internals
from florist.common.storage import cache_dir


def checkout() -> Path:
    """The florist source checkout this package runs from."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").exists():
        raise FileNotFoundError(
            f"no pyproject.toml in {root}: runs are submitted from a florist source checkout "
            "(git clone, then pip install -e .)"
        )
    return root


def app_dir() -> Path:
    """The folder `flwr run` is given: the checkout's publishable files, staged in the cache
    under a hash of their contents. The bundle Flower builds from it is byte for byte the one
    it would build from the checkout, without walking the checkout's .venv first. Off the fast
    path (another Flower than florist's), the checkout itself: Flower walks it by its own rules."""
    if not flower_internals.fast_path():
        return checkout()
    files = flower_internals.publishable_files(checkout())
    digest = hashlib.sha256()
    for name, path in sorted(files.items()):
        digest.update(f"{name}\0{path.stat().st_size}\0".encode() + path.read_bytes())
    stage = cache_dir() / "app" / digest.hexdigest()[:16]
    if not stage.exists():
        scratch = stage.with_name(f"{stage.name}.{os.getpid()}.partial")
        shutil.rmtree(scratch, ignore_errors=True)
        for name, path in files.items():
            (scratch / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, scratch / name)
        try:
            scratch.rename(stage)
        except OSError:  # another process staged the same files first
            shutil.rmtree(scratch, ignore_errors=True)
    return stage
