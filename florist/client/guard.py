"""What a node takes from a server it need not trust, and what it tells it (DESIGN: "a node
takes file paths only from its own config and tells the server no more than a short reason
when it fails").

Paths. A node reads a folder only when its own `--node-config` names it: `public-dir`, and a
`dataset` that is a local folder (not an embedded dataset, `synthetic:ALPHA,BETA` or a Hugging
Face id), come from the node config when it sets them (its value wins), and a server message
naming one the node config does not set is refused before anything is read: the reply is the
same whether the folder exists or not (but for an OWNER/NAME id, which is a folder when the
working directory holds one of that name, as `datasets.load_dataset` reads it).

Caps. However the server sets up its run, one message does not make a node allocate more than
`node-max-classes` classes, take more than `node-max-steps` local optimizer steps, train in
batches of more than `node-max-batch-size` samples, decode images larger than `node-max-pixels`
(H×W of `image-size`), or work longer than `node-max-seconds` (the message's time-to-live,
which stops the handler, `client/deadline.py`); a request beyond
a cap is refused in one line naming the key that raises it, before anything is allocated or
trained. Nor do its messages together fill its disk: the decoded data are cached once per
folder and image size, within `node-max-cache-mb` (`common/datacache.py`), and the models it
keeps are its last `keep-models` runs' (`client/personal.py`). Flower's default time-to-live
(12 h, what a message gets whose sender set none) is not a request: such a message is cut at
the cap.

Hardware. A node's resources are its own: the server's `torch-threads` is cut to
`node-max-threads` (default: the cores the node may run on), and its `device` is ignored
unless it is `auto` (the node's `--node-config` names any other), so that a server can
neither take every core of the box nor learn, from an error, which devices it has.

Trusted servers. In the runs florist starts on one machine for one user, the server is the
user: its nodes read the folders it names and take its requests without caps (but those their
node config sets), as before. deploy-local's SuperNodes have `trusted-server = true` in their
node config, the in-process runner's nodes too (`runners/inprocess.py`), and Flower's
simulation, which builds its nodes' configs itself, runs its clients with
`FLORIST_TRUSTED_SERVER=1` in their environment (`runners/simulation.py`). Never a node that
joins someone else's federation.

Errors. A handler's exception is logged on the node in full, and the server gets an error
reply with only the message type, the exception's type name and a short reason: one line of
at most `REASON_CHARS` characters, with paths (quoted or bare text holding `/` or `\\`) and
lists of more than `LIST_ITEMS` items left out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from flwr.app import DEFAULT_TTL, Error, Message
from flwr.common.constant import ErrorCode

from florist.common import devices
from florist.common.data import EMBEDDED_SHAPES
from florist.common.scenarios import HUB_ID
from florist.common.settings import coerce

log = logging.getLogger("flwr").getChild(__name__)

TRUSTED_SERVER = "trusted-server"  # node-config key: this node's server is its own user
TRUSTED_SERVER_ENV = "FLORIST_TRUSTED_SERVER"  # ... and "1" in its environment, where florist builds no node config
REASON_CHARS, LIST_ITEMS = 200, 3


class Refused(ValueError):
    """A request this node does not take from a server; the message says which node-config
    key would let it."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """The node's caps on what one message may ask of it (node-config keys `node-max-*`)."""

    max_classes: int = 1000
    max_steps: int = 100_000
    max_seconds: float = 3600.0
    max_batch_size: int = 4096
    max_threads: int = 0  # 0: the cores this process may run on
    max_pixels: int = 1024 * 1024  # H×W of the server's image-size: decoded data grows with it, not with the files
    max_cache_mb: float = 4096.0  # the machine's decoded-data cache, least recently used entries out first

    @classmethod
    def of(cls, node_config: Mapping[str, Any]) -> Limits:
        """The caps the node config sets (the defaults for the others, none for a node whose
        server is trusted); a value that is no positive number is an error naming its key."""
        values = dict(UNLIMITED) if trusts_server(node_config) else {}
        for f in dataclasses.fields(cls):
            key = "node-" + f.name.replace("_", "-")
            if key in node_config:
                value = coerce(key, node_config[key], type(f.default))
                if not (value > 0 and math.isfinite(value)):
                    raise ValueError(f"node-config key {key!r} must be a number > 0, got {value!r}")
                values[f.name] = value
        return cls(**values)

    def check_classes(self, num_classes: int, who: str) -> None:
        if num_classes > self.max_classes:
            raise Refused(_over(who, f"num-classes {num_classes}", f"{self.max_classes} classes", "node-max-classes"))

    def check_steps(self, steps: int, who: str) -> None:
        if steps > self.max_steps:
            raise Refused(_over(who, f"{steps} local steps", f"{self.max_steps}", "node-max-steps"))

    def check_batch_size(self, batch_size: int, who: str) -> None:
        if batch_size > self.max_batch_size:
            raise Refused(_over(who, f"batch-size {batch_size}", f"{self.max_batch_size}", "node-max-batch-size"))

    def check_image_size(self, size: tuple[int, int] | None, who: str) -> None:
        if size is not None and size[0] * size[1] > self.max_pixels:
            asked = f"image-size {size[0]},{size[1]} ({size[0] * size[1]} pixels)"
            raise Refused(_over(who, asked, f"{self.max_pixels} pixels", "node-max-pixels"))

    def threads(self, asked: int, who: str) -> int:
        """The torch threads this node runs a message with when the server asks for `asked`
        (0: as many as the node has): at most `node-max-threads`, said in the node's log."""
        if asked == 0:  # as many as the node has: its cap, where its config sets one
            return self.max_threads if 0 < self.max_threads < sys.maxsize else 0
        cap = self.max_threads or devices.usable_cores()
        if asked <= cap:
            return asked
        log.info(
            "%s: the server asks for torch-threads %d, this node uses its cap of %d (node-max-threads)", who, asked, cap
        )
        return cap

    def seconds(self, msg: Message, who: str) -> float:
        """How long the node works on `msg`: its time-to-live, refused when over the cap
        (Flower's default, which no sender chose, is cut to the cap)."""
        ttl = msg.metadata.ttl
        if ttl == DEFAULT_TTL:
            return min(ttl, self.max_seconds)
        if ttl > self.max_seconds:
            raise Refused(_over(who, f"a deadline of {ttl:g} s", f"{self.max_seconds:g} s", "node-max-seconds"))
        return ttl


UNLIMITED = {
    "max_classes": sys.maxsize,
    "max_steps": sys.maxsize,
    "max_seconds": math.inf,
    "max_batch_size": sys.maxsize,
    "max_threads": sys.maxsize,
    "max_pixels": sys.maxsize,
    "max_cache_mb": math.inf,
}


def _over(who: str, asked: str, cap: str, key: str) -> str:
    return f"{who}: the server asks for {asked}, over this node's cap of {cap} (raise {key} in its --node-config)"


def trusts_server(node_config: Mapping[str, Any]) -> bool:
    """Whether this node's server is its own user's (see the module docstring)."""
    if TRUSTED_SERVER in node_config:
        return coerce(TRUSTED_SERVER, node_config[TRUSTED_SERVER], bool)
    return os.environ.get(TRUSTED_SERVER_ENV) == "1"


@contextlib.contextmanager
def trusted_server_in_environment() -> Iterator[None]:
    """`FLORIST_TRUSTED_SERVER=1` in this process's environment for the block, inherited by the
    processes it starts: for the clients of a run that florist starts for its user, whose node
    configs Flower builds (its simulation's Ray workers)."""
    before = os.environ.get(TRUSTED_SERVER_ENV)
    os.environ[TRUSTED_SERVER_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TRUSTED_SERVER_ENV, None)
        else:
            os.environ[TRUSTED_SERVER_ENV] = before


def names_a_folder(dataset: str) -> bool:
    """Whether the `dataset` value would be read as a local folder. Decided from the text, but
    for an OWNER/NAME id, which `datasets.load_dataset` reads from a folder of that name
    relative to the working directory when there is one."""
    kind, colon, _ = dataset.partition(":")
    if not dataset or (kind in EMBEDDED_SHAPES and not colon) or kind == "synthetic":
        return False
    return not HUB_ID.fullmatch(dataset) or Path(dataset).exists()


def own_paths(values: Mapping[str, Any], node_config: Mapping[str, Any], who: str) -> dict[str, Any]:
    """The server's settings `values` (type-checked whole: `RunConfig.check_types`) with the
    node's own `dataset`, `public-dir`, `models-root` and `keep-models` in place of the server's;
    Refused when the server names a folder that the node config does not set."""
    own = {
        key: node_config[key] for key in ("dataset", "public-dir", "models-root", "keep-models") if key in node_config
    }
    values = dict(values) | own
    if trusts_server(node_config):
        return values
    if "keep-models" not in own:  # how many models it keeps is the node's to say too (its default)
        values.pop("keep-models", None)
    if "models-root" not in own and values.get("models-root"):
        log.info("%s: the server's models-root is ignored; this node keeps its models in its state folder", who)
        values["models-root"] = ""
    if "dataset" not in own and names_a_folder(str(values.get("dataset", ""))):
        raise Refused(_folder(who, "dataset", "dataset=..."))
    if "public-dir" not in own and values.get("public-dir"):
        raise Refused(_folder(who, "public-dir", "public-dir=..."))
    return values


PRIVACY_KEYS = ("dp", "dp-clip", "dp-epsilon", "dp-delta", "dp-noise-multiplier", "dp-relation", "dp-noise-seed")
USER_KEYS = ("dp-user-epsilon", "dp-user-clip", "dp-user-noise-multiplier")  # under dp = "record+…": the one on top
PRIVACY_KEYS += USER_KEYS
DP_DEFAULTS = {"dp": "none", "dp-clip": 1.0, "dp-epsilon": math.inf, "dp-delta": 1e-5, "dp-noise-multiplier": 0.0}
DP_DEFAULTS |= {"dp-relation": "zero-out", "dp-user-epsilon": math.inf, "dp-user-clip": 1.0}
DP_DEFAULTS |= {"dp-user-noise-multiplier": 0.0}


def _sized_alike(values: Mapping[str, Any]) -> dict[str, Any]:
    """What secure aggregation sizes alike for every node of `values`' dp: its user-level mechanism and
    that one's keys (record-level DP-SGD is each node's own: its σ, C and ε may differ from node to node)."""
    full = DP_DEFAULTS | {key: values[key] for key in DP_DEFAULTS if key in values}
    mode = str(full["dp"])
    if mode == "record" or mode.startswith("record+"):
        user = {"dp-epsilon": full["dp-user-epsilon"], "dp-clip": full["dp-user-clip"]}
        user |= {"dp-noise-multiplier": full["dp-user-noise-multiplier"]}
        full = {k: v for k, v in full.items() if k not in USER_KEYS} | user | {"dp": mode.removeprefix("record")}
        full["dp"] = full["dp"].removeprefix("+") or "none"
    if full["dp"] == "none":
        return {"dp": "none"}
    return {k: v for k, v in full.items() if k not in USER_KEYS}


def own_privacy(values: Mapping[str, Any], node_config: Mapping[str, Any], who: str) -> dict[str, Any]:
    """The server's settings `values` with the node's own differential privacy in place of the
    server's. A node config that sets `dp` is a promise the node makes itself: none of the
    server's privacy settings apply then (what it does not set takes the defaults), so the server
    can neither turn it off nor weaken it; under secure aggregation, whose noise and weights the
    server sizes for every node alike, a node whose own settings differ from the server's is
    refused in one line. A node that does not trust its server draws its noise from the
    operating system whatever `dp-noise-seed` the server sends (whoever knows it can subtract it)."""
    mine = {key: node_config[key] for key in PRIVACY_KEYS if key in node_config}
    values = dict(values)
    if "dp" in mine:
        ours, theirs = _sized_alike(mine), _sized_alike(values)
        differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        if values.get("secure-aggregation", "none") != "none" and differ:
            raise Refused(
                f"{who}: its own {', '.join(differ or ['dp'])} differ from the server's under secure aggregation, "
                "which sizes every node's noise and weight alike; leave dp out of this node's --node-config, or match "
                "the run"
            )
        values = {key: v for key, v in values.items() if key not in PRIVACY_KEYS}
    values |= mine
    if not trusts_server(node_config) and "dp-noise-seed" not in node_config and values.get("dp-noise-seed"):
        log.info("%s: the server's dp-noise-seed is ignored; this node draws its noise from the OS", who)
        values["dp-noise-seed"] = 0
    return values


def own_hardware(values: Mapping[str, Any], node_config: Mapping[str, Any], who: str) -> dict[str, Any]:
    """The server's settings `values` with its `device` and `torch-threads` as this node takes
    them (see the module docstring); the node config's own values are applied later, and win."""
    values = dict(values)
    if trusts_server(node_config):
        return values
    if values.get("device", "auto") != "auto":
        log.info(
            "%s: the server's device %r is ignored; set device=... in this node's --node-config", who, values["device"]
        )
        values["device"] = "auto"
    threads = coerce("torch-threads", values.get("torch-threads", 0), int)
    values["torch-threads"] = Limits.of(node_config).threads(threads, who)
    return values


def _folder(who: str, key: str, setting: str) -> str:
    return (
        f"{who}: the server names a local folder for {key}; a node reads folders only from its own "
        f"--node-config (set {setting} there)"
    )


def error_reply(msg: Message, err: Exception) -> Message:
    """The reply to `msg` whose handler raised `err`: logged here in full, and to the server
    an error with the message type, the exception's type name and a short reason."""
    message_type = msg.metadata.message_type
    cause = err.__cause__ or err.__context__
    detail = f" (from {type(cause).__name__}: {cause})" if cause is not None else ""
    bug = not isinstance(err, ValueError | OSError | ArithmeticError)  # not the data's, a setting's or a request's
    log.error("%s failed: %s: %s%s", message_type, type(err).__name__, err, detail, exc_info=err if bug else None)
    reason = f"{type(err).__name__} in {message_type}: {short_reason(str(err))}"
    return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=msg)


def short_reason(text: str) -> str:
    """`text` as the server may see it: one line, paths and long lists left out, cut short."""
    text = " ".join(text.split())
    text = re.sub(r"'[^']*'|\"[^\"]*\"", lambda m: "'…'" if re.search(r"[/\\]", m[0]) else m[0], text)
    text = re.sub(r"[^\s'\"]*[/\\][^\s'\"]*", "…", text)
    text = re.sub(r"\[[^\[\]]*\]", _short_list, text)
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 1] + "…"


def _short_list(match: re.Match) -> str:
    items = match[0].count(",") + 1
    return f"[{items} items]" if items > LIST_ITEMS else match[0]
