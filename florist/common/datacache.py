"""A client's decoded data on disk, so that a dataset is decoded once per machine, not once per
message: each `ClientData` array is an `.npy` file (images stay uint8), memory-mapped when
read, so the processes of one node (the warm executor's children, Ray's workers) share its
pages instead of each holding a copy.

An entry is a folder named by the hash of what the data was built from (the dataset's id or
the folder's file listing, the partitioner, seed, partition...), written whole before it is
used: a changed input is a new entry. `meta.json`, written last, records each file's size,
modification time and SHA-256; a file whose size or time differ from its record is hashed
again, and one whose hash differs (a truncated or edited file) is rebuilt with a warning,
never read.

The cache is bounded (`cached`'s `limit_bytes`, a node's `node-max-cache-mb`): an entry's
folder time is when a process last read it, and a new entry pushes the least recently read
ones out until the whole fits, each said in the log.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from florist.common.data import ClientData
from florist.common.storage import atomic_write, cache_dir

log = logging.getLogger("flwr").getChild(__name__)  # in the node's log, beside Flower's
VERSION = 3  # of the entries and of how data is decoded into them (3: the skipped files named); in every key
ARRAYS = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")


def folder_fingerprint(root: Path) -> str:
    """A hash of a folder's file listing (relative path, size, modification time): any added,
    removed, resized or rewritten file changes it, without reading the files. Walked with
    `os.scandir` on every message, so it stays cheap: 15,000 files in 0.05 s here (`Path.rglob`
    took 0.27 s)."""
    lines, folders = [], [(str(root), "")]
    while folders:
        path, prefix = folders.pop()
        try:
            with os.scandir(path) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):  # a link back up would never end
                        folders.append((entry.path, f"{prefix}{entry.name}/"))
                    elif entry.is_file():
                        stat = entry.stat()
                        lines.append(f"{prefix}{entry.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n")
        except (FileNotFoundError, NotADirectoryError):  # no such folder: the loader that follows says so
            pass
    return hashlib.sha256("".join(sorted(lines)).encode()).hexdigest()


def entry(key: dict[str, Any]) -> Path:
    """The cache folder of data built from `key` (JSON-serializable)."""
    text = json.dumps({"version": VERSION} | key, sort_keys=True, default=str)
    return cache_dir() / "data" / hashlib.sha256(text.encode()).hexdigest()[:32]


def cached(key: dict[str, Any], build: Callable[[], ClientData], limit_bytes: float = math.inf) -> ClientData:
    """The data built from `key`: from this process's memory, else the disk cache, else
    `build()`, saved for the next process and read back memory-mapped like every later read;
    a new entry makes room for itself within `limit_bytes` (`evict`)."""
    folder = entry(key)
    if folder not in _MEMORY:
        client = load(folder)
        if client is None:
            built = build()
            try:
                _save(folder, built)
                evict(folder.parent, limit_bytes, folder)
            except OSError as err:  # a full or read-only disk costs speed, not the run
                log.warning("cannot keep decoded data in %s (%s); it will be decoded again next time", folder, err)
            client = load(folder) or built
        else:
            os.utime(folder)  # read now: the last to leave
        if len(_MEMORY) >= 256:  # memory maps cost little, but a long-lived process need not keep all
            _MEMORY.pop(next(iter(_MEMORY)))
        _MEMORY[folder] = client
    return _MEMORY[folder]


_MEMORY: dict[Path, ClientData] = {}


def evict(root: Path, limit_bytes: float, keep: Path) -> None:
    """Remove the least recently read entries under `root` (but `keep`, the one just written)
    until they total at most `limit_bytes`, each said in the log."""
    if math.isinf(limit_bytes):
        return
    entries = [(f.stat().st_mtime, f, size_of(f)) for f in root.iterdir() if f.is_dir() and not f.name.startswith(".")]
    total = sum(size for _, _, size in entries)
    for _, folder, size in sorted(entries, key=lambda e: e[0]):
        if total <= limit_bytes:
            break
        if folder != keep:
            shutil.rmtree(folder, ignore_errors=True)
            total -= size
            log.info(
                "data cache over %g MB: removed %s (%g MB, the least recently read)",
                limit_bytes / 1e6,
                folder,
                size / 1e6,
            )
    if total > limit_bytes:
        log.warning("data cache: the entry %s alone is over its %g MB", keep, limit_bytes / 1e6)


def size_of(folder: Path) -> int:
    """The bytes of the files under `folder`."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def remembered(key: dict[str, Any], build: Callable[[], dict]) -> dict:
    """A small JSON result built from `key` (a dataset's image sizes, `folders.survey`), kept
    beside the decoded entries so that it is built once per machine, not once per partition."""
    path = entry(key).with_suffix(".json")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not there yet, or damaged: build it again
        pass
    value = build()
    try:
        atomic_write(path, lambda f: f.write(json.dumps(value).encode()))
    except OSError as err:
        log.warning("cannot keep %s (%s); it will be built again next time", path, err)
    return value


def load(folder: Path) -> ClientData | None:
    """The entry in `folder`, memory-mapped; None (with a warning when something was there but
    is damaged) when it cannot be trusted."""
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        arrays = {name: _checked(folder / f"{name}.npy", meta["files"][name]) for name in meta["files"]}
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("data cache %s is damaged (%s); decoding the data again", folder, err)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    skipped = {
        "skipped_images": int(meta.get("skipped_images", 0)),
        "skipped_files": tuple(meta.get("skipped_files", ())),
    }
    return ClientData(**{name: arrays.get(name) for name in ARRAYS}, num_classes=meta["num_classes"], **skipped)


def _checked(path: Path, record: dict[str, Any]) -> np.ndarray:
    stat = path.stat()
    if (stat.st_size, stat.st_mtime_ns) != (record["size"], record["mtime_ns"]) and _sha256(path) != record["sha256"]:
        raise ValueError(f"{path.name} differs from what was written ({stat.st_size} bytes, {record['size']} recorded)")
    return np.load(path, mmap_mode="r", allow_pickle=False)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _save(folder: Path, client: ClientData) -> None:
    """Write the entry beside its final place, then move it there whole (a write cut short,
    by an error or a Ctrl-C, leaves nothing behind)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        files = {}
        for name in ARRAYS:
            array = getattr(client, name)
            if array is not None:
                path = staging / f"{name}.npy"
                np.save(path, np.ascontiguousarray(array), allow_pickle=False)
                stat = path.stat()
                files[name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": _sha256(path)}
        meta = {"num_classes": client.num_classes, "files": files, "skipped_images": client.skipped_images}
        meta["skipped_files"] = list(client.skipped_files)  # named in the node's log on every later read
        atomic_write(staging / "meta.json", lambda f: f.write(json.dumps(meta).encode()))
        shutil.rmtree(folder, ignore_errors=True)  # a damaged entry, or one another process wrote meanwhile
        staging.rename(folder)
    except OSError:  # another process put its (equal) entry there first, or the disk refused
        if not folder.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already once renamed
