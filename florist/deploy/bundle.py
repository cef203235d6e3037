"""The app bundle `flwr run` submits: florist's publishable files, staged from the checkout."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from florist.common import flower_internals
from florist.common.flower_internals.apptrust import Refused
from florist.common.storage import cache_dir

log = logging.getLogger(__name__)

SHA256 = re.compile(r"[0-9a-f]{64}")


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
    if os.path.lexists(stage) and not _holds_exactly(stage, files):  # whoever can write the cache chose it
        log.warning("%s does not hold the files it is named for: staging them afresh", stage)
        _remove(stage)
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


def _holds_exactly(stage: Path, files: dict[str, Path]) -> bool:
    """Whether `stage` (no link, nor any link in it) holds these files, byte for byte, and no other."""
    if stage.is_symlink() or not stage.is_dir():
        return False
    found = {p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_symlink() or not p.is_dir()}
    return found == set(files) and all(
        not (stage / name).is_symlink() and (stage / name).read_bytes() == path.read_bytes()
        for name, path in files.items()
    )


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


def bundle_hash(folder: Path | None = None) -> str:
    """The sha256 of the app bundle `flwr run FOLDER` builds (default: florist's checkout): the
    hash by which a SuperNode's tasks name a run's bundle, and the warm executor knows its own."""
    folder = Path(folder).expanduser().resolve() if folder else checkout()
    if not (folder / "pyproject.toml").is_file():
        raise FileNotFoundError(f"{folder}: no pyproject.toml, so no app bundle is built from it")
    if flower_internals.unusable("publish"):
        from flwr.cli.build import build_fab_from_disk

        return hashlib.sha256(build_fab_from_disk(folder)).hexdigest()
    return hashlib.sha256(flower_internals.fab_bytes(folder)).hexdigest()


@dataclasses.dataclass(frozen=True)
class TrustedApps:
    """The app bundles a box runs, by sha256 (`florist supernode --trust-app`): called with a
    run's bundle hash, None if it may run here, else why not (`apptrust.Refused`)."""

    hashes: frozenset[str]

    @classmethod
    def parse(cls, values: Iterable[str]) -> TrustedApps:
        """From `--trust-app` values; ValueError naming the first that is not a sha256."""
        hashes = [v.strip().lower() for v in values]
        if bad := [v for v in hashes if not SHA256.fullmatch(v)]:
            raise ValueError(
                f"--trust-app {bad[0]!r}: expected the 64 hex digits of an app bundle's sha256 "
                "(`florist app-hash DIR` prints the one `flwr run DIR` submits)"
            )
        return cls(frozenset(hashes))

    def __call__(self, fab_hash: str) -> Refused | None:
        if fab_hash in self.hashes:
            return None
        return Refused(
            fab_hash,
            f"app bundle {fab_hash} refused: this node runs only the apps its operator trusts",
            f"refused app bundle {fab_hash}: this box does not trust it, nothing of it was fetched or run "
            f"(to run it here, restart this node with --trust-app {fab_hash})",
        )
