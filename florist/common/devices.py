"""Where a process computes: the torch device a `device` setting names, and how many CPU
threads torch may use. `parse` imports nothing, so a run config is checked in milliseconds;
`resolve` asks torch what this machine has and refuses, in one line, a device it lacks."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

FORMS = "'auto' (CUDA if present, else CPU), 'cpu', 'cuda', 'cuda:N' or 'mps'"


def parse(text: str) -> bool:
    """Whether `text` is one of `FORMS` (not whether this machine has it)."""
    return bool(re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", text))


def available() -> str:
    """What this machine offers, in words, for error messages."""
    import torch

    found = ["cpu"]
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        found += ["cuda"] + [f"cuda:{i}" for i in range(count)]
    if torch.backends.mps.is_available():
        found.append("mps")
    return ", ".join(found)


def resolve(text: str, where: str = "device"):
    """The `torch.device` for `text` on this machine; `auto` is CUDA when torch sees a GPU,
    else the CPU. A ValueError naming `where`, the device and what is available otherwise."""
    import torch

    if not parse(text):
        raise ValueError(f"{where} {text!r} is not one of {FORMS}")
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(text)
    usable = {
        "cpu": True,
        "cuda": torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count(),
        "mps": torch.backends.mps.is_available(),
    }[device.type]
    if not usable:
        raise ValueError(f"{where} {text!r} is not available on this machine (available: {available()})")
    return device


def moved(tensors: Mapping[str, Any], device) -> dict[str, Any]:
    """`tensors` (a state dict) on `device`; the same tensors where they are there already."""
    return {key: value.to(device) for key, value in tensors.items()}


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_RUNTIME_CPUS: list[float] = []  # set by `client_cpus` for the clients a runtime runs in this process


@contextlib.contextmanager
def client_cpus(cpus: float) -> Iterator[None]:
    """Inside the block, the clients of this process get `cpus` cores each (as Ray's
    resources say in a simulation): florist's in-process runtime, which runs one at a time."""
    _RUNTIME_CPUS.append(cpus)
    try:
        yield
    finally:
        _RUNTIME_CPUS.pop()


def client_cores() -> int:
    """The cores a client may use: what the runtime gave it (Ray's resources in Flower's
    simulation, `client_cpus` in-process), at least one; elsewhere every core this process
    may run on."""
    if _RUNTIME_CPUS:
        return max(1, int(_RUNTIME_CPUS[-1]))
    ray = sys.modules.get("ray")  # never imported here: only a process that runs Ray has it
    if ray is not None and ray.is_initialized():
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
        if cpus:
            return max(1, int(cpus))
    return usable_cores()


def set_torch_threads(count: int) -> int:
    """Let torch use `count` threads for its operators (0: `client_cores()`); returns the
    count set. Changing it is cheap, so a process that serves several clients sets it per
    message."""
    import torch

    count = count or client_cores()
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count
