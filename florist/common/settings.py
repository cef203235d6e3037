"""Settings: dataclasses whose fields map to Flower's flat kebab-case run-config keys. Field
`sigmas` of a section with prefix `knn` is key `knn-sigmas` (a field may name its key outright).
Each field says whether it travels to the clients and whether a node's `--node-config` may
override it. The run's common settings (`florist/config.py`) and each strategy's section
(its `spec.py`) are such classes; nothing here imports torch."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, ClassVar


@functools.cache
def _fields(cls: type[Settings]) -> tuple[tuple[str, dataclasses.Field], ...]:
    pairs = ((f.name.replace("_", "-"), f) for f in dataclasses.fields(cls) if not f.metadata.get("section"))
    return tuple((f.metadata.get("key") or (f"{cls.prefix}-{name}" if cls.prefix else name), f) for name, f in pairs)


def setting(default: Any, *, key: str = "", server: bool = False, node: bool = False) -> Any:
    """A settings field. `server`: it stays on the server (never sent to clients); `node`: a
    node's `--node-config` value wins over the run's; `key`: the run-config key, when it is
    not `<prefix>-<field>`."""
    return dataclasses.field(default=default, metadata={"key": key, "server": server, "node": node})


@dataclasses.dataclass(frozen=True)
class Settings:
    """A group of settings under one key prefix; subclasses add fields and `checks`."""

    prefix: ClassVar[str] = ""

    @classmethod
    def fields(cls) -> tuple[tuple[str, dataclasses.Field], ...]:
        """(run-config key, field) of every setting: worked out once per class, as every
        message a node parses walks them several times."""
        return _fields(cls)

    @classmethod
    def keys(cls, travelling: bool = False) -> list[str]:
        return [key for key, f in cls.fields() if not (travelling and f.metadata.get("server"))]

    @classmethod
    def node_keys(cls) -> list[str]:
        """The keys a node's `--node-config` overrides."""
        return [key for key, f in cls.fields() if f.metadata.get("node")]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], strict: bool = False) -> Settings:
        """The settings from the keys of `values` that are ours (defaults for the rest; with
        `strict`, a missing key is an error), type-checked and validated."""
        settings = cls(**cls.typed(values, strict))
        for ok, message in settings.checks():
            if not ok:
                raise ValueError(f"invalid run config: {message}")
        return settings

    @classmethod
    def typed(cls, values: Mapping[str, Any], strict: bool = False) -> dict[str, Any]:
        """Our keys of `values` as field-name arguments, each of its field's type: the type check
        without `checks`, some of which look at the file system (a dataset folder)."""
        kwargs = {}
        for key, f in cls.fields():
            if key in values and values[key] is None and isinstance(f.default, float) and math.isinf(f.default):
                kwargs[f.name] = f.default  # results.json writes an infinite default (dp-epsilon) as null
            elif key in values:
                kwargs[f.name] = coerce(key, values[key], type(f.default))
            elif strict:
                raise ValueError(f"setting {key!r} is missing")
        return kwargs

    def to_mapping(self, travelling: bool = False) -> dict[str, Any]:
        """`{kebab-key: value}`; with `travelling`, only what the clients are sent."""
        return {key: getattr(self, f.name) for key, f in self.fields() if not (travelling and f.metadata.get("server"))}

    def for_node(self, node_config: Mapping[str, Any]) -> Settings:
        """These settings with the node's overrides (`node=True` fields) applied."""
        mine = {key: node_config[key] for key in self.node_keys() if key in node_config}
        return self.from_mapping(self.to_mapping() | mine) if mine else self

    def checks(self) -> list[tuple[bool, str]]:
        """(holds, message naming the key) for each constraint on the values."""
        return []

    def warnings(self, num_rounds: int) -> list[str]:
        """What will run, but not as the user likely meant with `num_rounds` rounds (e.g. a
        warm-up that outlasts the run, so the algorithm never acts)."""
        return []


@dataclasses.dataclass(frozen=True)
class NoSettings(Settings):
    """For an algorithm or exchange that needs none."""


def coerce(key: str, value: Any, kind: type) -> Any:
    """`value` as a `kind`, accepting ints for floats (TOML `1` vs `1.0`), nothing else implicit."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"run-config key {key!r} expects {kind.__name__}, got {value!r} ({type(value).__name__})")
    return value
