"""`checkpoint.pt`: everything a run needs to go on from its last finished round.

Written after every round (atomically, before results.json), read by `resume-from`: the round
reached, the run's config, the run id its nodes key their state by, the nodes it trained with,
the server half's full state (networks, optimizers, memories), the failures and round rows.
Sampling and the clients' shuffling are seeded by the round, so nothing else carries over:
a resumed run repeats exactly what the uninterrupted run would have done; but under central dp
with fraction-train < 1 the sample comes from the OS (docs/privacy.md#accounting), and the
server half's state carries the privacy ledger each resumed round adds to.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from florist.common.storage import atomic_write
from florist.config import RunConfig

FILE = "checkpoint.pt"
VERSION = 2
# Keys a resumed run may change: where and how long it waits, not what it computes. Where it
# computes is one of them (a run started on a GPU box may go on on a CPU one); the resumed
# rounds then round differently: exact only on equal hardware.
OPERATIONAL = (
    "resume-from",
    "results-dir",
    "round-timeout",
    "node-wait-timeout",
    "serve-seconds",
    "serve-count",
    "device",
    "server-device",
    "torch-threads",
    "trackers",
    "tracking-dir",
)
# Keys whose default changed, with the value every run had before the key existed: a run
# checkpointed then goes on as it started (PeFLL read no class means before `hn-class-means`).
PREDATING = {"hn-class-means": False}


@dataclasses.dataclass
class Checkpoint:
    round: int
    config: dict[str, Any]
    run_id: int  # the run id of the run's first part: nodes keep their state under it
    nodes: list[str]  # the keys of the nodes discovered at the start
    state: dict[str, Any]  # the server half's `ServerStrategy.state()`
    failures: list[dict[str, Any]]
    rounds: list[dict[str, Any]]
    bindings: dict[str, int] = dataclasses.field(default_factory=dict)  # node key -> SuperNode, `bind-node-keys`

    def save(self, folder: Path) -> None:
        atomic_write(folder / FILE, lambda f: torch.save({"version": VERSION} | dataclasses.asdict(self), f))

    @classmethod
    def load(cls, folder: str | Path) -> Checkpoint:
        """The checkpoint in `folder`; a missing, unreadable or older-format one is a one-line error."""
        path = Path(folder).expanduser() / FILE
        if not path.is_file():
            raise FileNotFoundError(f"cannot resume: {path} does not exist (a run writes it after its first round)")
        try:
            saved = torch.load(path, weights_only=True, map_location="cpu")  # to whatever device the run uses now
        except Exception as err:
            raise ValueError(
                f"cannot resume: {path} is not a readable checkpoint ({type(err).__name__}: {err})"
            ) from None
        if not isinstance(saved, dict) or saved.get("version") != VERSION:
            found = saved.get("version", 1) if isinstance(saved, dict) else "none"
            raise ValueError(
                f"cannot resume from {path}: checkpoint format {found}, this florist reads format {VERSION} "
                "(written by a different florist version)"
            )
        kinds = {
            "round": int,
            "config": dict,
            "run_id": int,
            "nodes": list,
            "state": dict,
            "failures": list,
            "rounds": list,
        }
        wrong = [name for name, kind in kinds.items() if not isinstance(saved.get(name), kind)]
        bindings = saved.get("bindings", {})  # absent from a checkpoint written before keys could be bound
        if not isinstance(bindings, dict) or not all(
            isinstance(k, str) and type(v) is int for k, v in bindings.items()
        ):
            wrong.append("bindings")
        if wrong:
            raise ValueError(f"cannot resume from {path}: the checkpoint lacks or garbles {', '.join(wrong)}")
        return cls(**{name: saved[name] for name in kinds} | {"config": PREDATING | saved["config"]}, bindings=bindings)

    def refuse_differences(self, values: Mapping[str, Any], folder: str | Path) -> None:
        """A one-line error naming each key of `values` whose value differs from the run's,
        operational keys aside."""
        differing = sorted(k for k, v in values.items() if k not in OPERATIONAL and self.config.get(k) != v)
        if differing:
            detail = ", ".join(f"{k} = {self.config.get(k)!r} there, {values[k]!r} here" for k in differing)
            raise ValueError(f"cannot resume from {folder}: the run config differs in {detail}")

    def check(self, cfg: RunConfig, node_keys: list[str]) -> None:
        """Refuse to go on with another config or other nodes, naming what differs."""
        self.refuse_differences(cfg.to_mapping(), cfg.resume_from)
        if missing := sorted(set(self.nodes) - set(node_keys)):
            raise ValueError(
                f"cannot resume from {cfg.resume_from}: node(s) {', '.join(missing)} of the run did not "
                "connect (a resumed run needs the nodes it started with)"
            )


def resumed_config(folder: str | Path, given: Mapping[str, Any]) -> RunConfig:
    """The config to resume the run in `folder` with: its own, with the operational keys of
    `given` on top (its results go to `folder` unless `given` says otherwise); any other key
    of `given` must equal the run's."""
    checkpoint = Checkpoint.load(folder)
    checkpoint.refuse_differences(given, folder)
    operational = {k: v for k, v in given.items() if k in OPERATIONAL}
    return RunConfig.from_mapping(
        checkpoint.config | {"results-dir": str(folder)} | operational | {"resume-from": str(folder)}
    )
