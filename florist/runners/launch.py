"""What a `florist` command hands a run and hears back: the `Launch` its flags asked for, and the
`Events` the run reports as it goes. The command parses into the one and prints the other; the
run (`runners/simulation.py`, `runners/compare.py`, `runners/deployment.py`) does the rest. Nothing
here imports torch, flwr or rich, so the command's parser stays quick to load."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Launch:
    """A run as the command line asked for it. `values`: the run-config values given (the flags,
    `--run-config` on top); `num_nodes`: the nodes to start, None for `default_nodes` (or, with
    `resume`, the resumed run's own); `runtime`, `ray_address` (the flag as given: None reads
    FLORIST_RAY_ADDRESS), `cpus_per_client` and `gpus_per_client`: where simulated nodes run."""

    values: Mapping[str, Any]
    num_nodes: int | None
    default_nodes: int
    resume: str | None = None
    runtime: str = "in-process"
    ray_address: str | None = None
    cpus_per_client: float = 1.0
    gpus_per_client: float | None = None


@dataclasses.dataclass(frozen=True)
class Federation:
    """A SuperLink and SuperNodes on this machine as the command line asked for them: their
    folder (`state_dir`), how the SuperNodes run ClientApps (`executor`), TLS and SuperNode
    authentication, the SuperLink's gRPC receive limit (None: sized from the run's model),
    `deploy-local`'s network namespaces, `local-federation`'s persistent SuperLink and the app
    bundles its SuperNodes run besides the checkout's."""

    state_dir: str | None = None
    executor: str = "warm"
    tls: bool = False
    auth: bool = False
    max_message_mb: float | None = None
    netns: bool = False
    persistent: bool = False
    trust_apps: tuple[str, ...] = ()


class Events:
    """What a run tells whoever started it; each is ignored here, and a command's display
    overrides those it shows. In order: `warning` for each doubt of the preflight; `planned`
    (`compare`: which runs it keeps, resumes, starts); `started` once every check passed (work
    is under way from then on: a Ctrl-C stops it and says what was kept); then, as they come,
    `decoded`/`decoding` (a dataset's partitions), `federation` (the processes are up), `run`
    (each run, of `runs`), `round` (each finished round) and `finished` (each run of a comparison
    done)."""

    def warning(self, text: str) -> None:
        """Something the preflight found doubtful; the run goes on."""

    def planned(self, kept: list[str], resumed: list[tuple[str, int]], started: list[str]) -> None:
        """What a comparison does with its runs (`strategy/seedK`), decided from their folders
        before any starts: `kept` finished with the same config, `resumed` (name, rounds done)
        from their checkpoint, `started` from round 1."""

    def started(self, runs: int, rounds: int) -> None:
        """Every check passed: `runs` runs of `rounds` rounds start."""

    def decoded(self, partitions: int, of: int) -> None:
        """`partitions` of the `of` partitions of a Hugging Face or folder dataset are decoded
        into the data cache (0 first, `of` last)."""

    def decoding(self, partition: int, done: int, total: int) -> None:
        """Partition `partition` is being decoded: `done` of `total`."""

    def federation(self, description: str) -> None:
        """The SuperLink and SuperNodes are up; `description` says where (their `describe()`)."""

    def stopping(self) -> None:
        """A Ctrl-C came: what was started is being stopped."""

    def run(self, strategy: str, seed: int, reused: bool) -> None:
        """A run of `strategy` with `seed` starts, or (`reused`) a finished one's results are kept."""

    def round(self, row: dict[str, Any]) -> None:
        """A round finished; `row` is its line of results.json."""

    def finished(self, results: dict[str, Any], seconds: float | None) -> None:
        """A run of a comparison is done: its results, and the `seconds` it took (None: kept)."""
