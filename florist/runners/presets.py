"""Paper presets: a paper's main experiment as a TOML file a user can copy and edit.

A preset names the strategies, seeds, clients and run config of the experiment as published
(`full`: the paper's dataset by hub id, its model, partition, rounds and hyperparameters) and
the same recipe sized for a laptop (`small`: embedded data, a small model), plus the figures the
paper reports, which `compare.md` prints beside florist's. The shipped presets live in
`florist/presets/`; `--preset` also takes the path of a user's own file.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

FOLDER = Path(__file__).resolve().parent.parent / "presets"
SCALES = ("full", "small")
# keys of a preset file's top level and of its scale tables
META = ("paper", "reproduces", "input-shape", "paper-values", *SCALES)
SCALE_KEYS = ("strategies", "seeds", "num-clients", "runtime", "run-config")


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    paper: str  # the paper, as cited
    reproduces: str  # which table/figure and setting, in words
    input_shape: tuple[int, ...]  # of the full-scale data: what its models are built for
    paper_values: dict[str, dict[str, float]]  # strategy -> {"seen": %, "unseen": %}, as the paper reports them
    scale: str
    strategies: list[str]
    seeds: list[int]
    num_clients: int
    runtime: str | None  # None: the command's default
    run_config: dict[str, Any]

    def source(self) -> str:
        return f"{self.paper}: {self.reproduces}"


def names() -> list[str]:
    """The presets florist ships."""
    return sorted(p.stem for p in FOLDER.glob("*.toml"))


def path_of(name: str) -> Path:
    """A shipped preset's file, or `name` itself when it is a path to a TOML file."""
    if name.endswith(".toml") or "/" in name:
        return Path(name).expanduser()
    if name not in names():
        raise ValueError(f"--preset: no preset {name!r}; the presets are {', '.join(names())} (or a .toml file)")
    return FOLDER / f"{name}.toml"


def load(name: str, scale: str = "full") -> Preset:
    """The preset `name` (a shipped one or a file) at `scale`; a ValueError naming the file and
    the key for anything malformed."""
    path = path_of(name)
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"--preset: cannot read {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"--preset: {path} is not valid TOML: {err}") from None
    where = lambda key: f"--preset: {path}: {key}"  # noqa: E731
    _known(doc, META, where(""))
    if scale not in SCALES:
        raise ValueError(f"--scale must be one of {', '.join(SCALES)}, got {scale!r}")
    part = doc.get(scale)
    if not isinstance(part, dict):
        raise ValueError(where(f"no [{scale}] table"))
    _known(part, SCALE_KEYS, where(f"[{scale}]"))
    if part.get("runtime", "simulation") not in ("simulation", "in-process"):
        raise ValueError(where(f"[{scale}] runtime must be simulation or in-process, got {part['runtime']!r}"))
    return Preset(
        name=path.stem,
        paper=_typed(doc, "paper", str, where),
        reproduces=_typed(doc, "reproduces", str, where),
        input_shape=tuple(_typed(doc, "input-shape", list, where)),
        paper_values=_paper_values(doc.get("paper-values", {}), where),
        scale=scale,
        strategies=_typed(part, "strategies", list, where),
        seeds=_typed(part, "seeds", list, where),
        num_clients=_typed(part, "num-clients", int, where),
        runtime=part.get("runtime"),
        run_config=_typed(part, "run-config", dict, where),
    )


def _known(table: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    if unknown := sorted(set(table) - set(allowed)):
        raise ValueError(f"{where} unknown key {unknown[0]!r}; the keys are {', '.join(allowed)}")


def _typed(table: dict[str, Any], key: str, kind: type, where) -> Any:
    if not isinstance(value := table.get(key), kind) or isinstance(value, bool):
        raise ValueError(where(f"{key!r} must be a {kind.__name__}, got {value!r}"))
    return value


def _paper_values(table: Any, where) -> dict[str, dict[str, float]]:
    """`{strategy: {seen: %, unseen: %}}`: the accuracies the paper reports (either may be absent)."""
    values = {}
    for strategy, groups in table.items():
        ok = isinstance(groups, dict) and set(groups) <= {"seen", "unseen"}
        if not ok or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in groups.values()):
            raise ValueError(where(f"paper-values.{strategy} must be {{seen = %, unseen = %}}, got {groups!r}"))
        values[strategy] = {g: float(v) for g, v in groups.items()}
    return values
