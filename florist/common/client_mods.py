"""Flower's client mods by name, so a deployment chooses them in its configuration instead of
in code: `client-mods="fixedclipping"` is what `DifferentialPrivacyClientSideFixedClipping`
needs on every client. Names come from the node config, else the message's config (florist's
server sends the run's), else the run config, as in `client/node.py`; a mod's `_mod` suffix
may be left out. Flower's own mods are imported on first use: the run config is checked
without them.

Below them, outside MODS, `attack`: a malicious-node mod for tests and benchmarks only."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

KEY = "client-mods"

# name: (the mod, the message types it wraps; empty: all). The clipping mods rewrite a `train`
# reply's model against the model that came down and refuse a message without a clipping norm,
# so they wrap Flower's `train` only, as its DP strategies expect.
MODS = {
    "fixedclipping": (lambda: _flower_mods().fixedclipping_mod, ("train",)),
    "adaptiveclipping": (lambda: _flower_mods().adaptiveclipping_mod, ("train",)),
    "message_size": (lambda: _flower_mods().message_size_mod, ()),
    "arrays_size": (lambda: _flower_mods().arrays_size_mod, ()),
}


def _flower_mods():
    from flwr.clientapp import mod

    return mod


def _split(text: str) -> list[str]:
    return [name.strip().removesuffix("_mod") for name in text.split(",") if name.strip()]


def problem(text: str) -> str:
    """What is wrong with `text` as a `client-mods` value, in one line ("" when nothing)."""
    unknown = [name for name in _split(text) if name not in MODS]
    return f"unknown client mod {unknown[0]!r} in {KEY}; choose from {', '.join(MODS)}" if unknown else ""


def names(text: str) -> list[str]:
    """The mod names in comma-separated `text`, in order; an unknown one is a one-line error."""
    if error := problem(text):
        raise ValueError(error)
    return _split(text)


def configured(msg, context, call_next: Callable):
    """A ClientApp mod: run the Flower mods that `client-mods` names around this message, the
    first outermost (only those that wrap its message type)."""
    from florist.common.protocol import CONFIG

    config = msg.content.config_records.get(CONFIG, {})
    text = context.node_config.get(KEY, config.get(KEY, context.run_config.get(KEY, "")))
    handler = call_next
    for name in reversed(names(str(text))):
        mod, message_types = MODS[name]
        if not message_types or msg.metadata.message_type in message_types:
            handler = _around(mod(), handler)
    return handler(msg, context)


def _around(mod: Callable, inner: Callable) -> Callable:
    return lambda msg, context: mod(msg, context, inner)


# -- for tests and benchmarks only --------------------------------------------------------
# A mod that plays one malicious node, so tests/test_adversarial.py and benchmarks/robustness.py
# attack the same way. It is not in MODS: no configuration can switch it on.

HUGE = 10**12
MODEL_REPLIES = ("train", "train.attn")  # the replies that carry a trained model: FedAvg's, FedAttn's
INFO = "query.info"  # discovery, where a node reports its `num-train` and its key
DESCRIBE = "query.describe"  # PeFLL's and OD-PFL's descriptor reply


@dataclasses.dataclass(frozen=True)
class Role:
    """What one malicious node sends: θ_g + `factor`·Δ in its model replies (Δ its honest update
    from the θ_g it received; NaN: every weight NaN), and 10¹² examples claimed in those replies
    (`claim`) and at discovery (`claim_info`); at discovery the node key `key` instead of its own
    (when set); in PeFLL's descriptor replies [1e-10, 0, …] (`degenerate`)."""

    factor: float
    claim: bool = False
    claim_info: bool = False
    key: str = ""
    degenerate: bool = False


# attack: the roles of partitions `partition_id`, `partition_id` + 1, ... (`none`: nobody lies).
ROLES: dict[str, tuple[Role, ...]] = {
    "none": (),
    "scale": (Role(1000.0),),
    "flip": (Role(-1.0),),
    "claim": (Role(-1.0, claim=True),),
    "claim-info": (Role(-1.0, claim=True, claim_info=True),),
    "colluders": (Role(1000.0), Role(math.nan)),  # the NaN reply is refused: trimmed:β sees n − 1
    "stall": (Role(0.0, claim=True, claim_info=True),),  # no training, all the weight
    "noop": (Role(0.0),),
    "noop2": (Role(0.0), Role(0.0)),  # two identical no-op replies, more than krum:1 tolerates
    "squat": (Role(1.0, key="partition-3"),),  # honest otherwise: it only takes another node's key
    "standardizer": (Role(1.0, degenerate=True),),  # PeFLL with hn-standardize: partition-0 sorts first
}
ATTACKS = tuple(ROLES)


def attack(name: str, partition_id: int = 0) -> Callable:
    """FOR TESTS AND BENCHMARKS ONLY: a client mod with which node `partition_id` (and the next
    ones, for the attacks of several nodes) rewrites its replies, as `ROLES[name]` says.
    `scale`: θ_g + 1000·Δ; `flip`: θ_g − Δ; `claim`: flip and claim 10¹² examples in the model
    replies; `claim-info`: that, and report 10¹² training examples at discovery too;
    `colluders`: partition 0 scales, partition 1 sends NaN; `noop`: θ_g unchanged with honest
    counts (`noop2`: two such nodes); `stall`: θ_g unchanged, claiming 10¹² examples at
    discovery and in its replies; `squat`: report partition-3's key at discovery; `standardizer`:
    describe itself by [1e-10, 0, …] (PeFLL, OD-PFL); `none`: honest."""
    if name not in ROLES:
        raise ValueError(f"unknown attack {name!r}; choose from {', '.join(ATTACKS)}")
    roles = ROLES[name]

    def mod(msg, context, call_next):
        reply = call_next(msg, context)
        offset = int(context.node_config["partition-id"]) - partition_id
        if not 0 <= offset < len(roles) or not reply.has_content():
            return reply
        role, message_type = roles[offset], msg.metadata.message_type
        if message_type == INFO and role.claim_info:
            reply.content.metric_records[_protocol().METRICS]["num-train"] = HUGE
        if message_type == INFO and role.key:
            reply.content.config_records[_protocol().CONFIG]["node-key"] = role.key
        if message_type == DESCRIBE and role.degenerate:
            _degenerate(reply)
        if message_type in MODEL_REPLIES:
            _poison(msg, reply, role)
        return reply

    return mod


def _poison(msg, reply, role: Role) -> None:
    """Replace the reply's model θ with θ_g + factor·(θ − θ_g), θ_g the model `msg` sent
    (θ_g itself, bit for bit, for factor 0; NaN everywhere for a NaN factor)."""
    from flwr.app import ArrayRecord

    protocol = _protocol()
    sent = msg.content.array_records[protocol.ARRAYS].to_torch_state_dict()
    trained = reply.content.array_records[protocol.ARRAYS].to_torch_state_dict()
    poisoned = {k: _moved(sent[k], v, role.factor) if v.is_floating_point() else v for k, v in trained.items()}
    reply.content.array_records[protocol.ARRAYS] = ArrayRecord(poisoned)
    if role.claim:
        reply.content.metric_records[protocol.METRICS]["num-examples"] = HUGE


def _degenerate(reply) -> None:
    """Replace the reply's descriptor v by [1e-10, 0, …]: a spread of almost nothing, which a
    standardizer fitted on it alone would divide every other node's descriptor by."""
    from flwr.app import ArrayRecord

    protocol = _protocol()
    (key, v), *_ = reply.content.array_records[protocol.ARRAYS].to_torch_state_dict().items()
    lie = v.new_zeros(v.shape)
    lie.view(-1)[0] = 1e-10
    reply.content.array_records[protocol.ARRAYS] = ArrayRecord({key: lie})


def _moved(sent, trained, factor: float):
    if math.isnan(factor):
        return sent.new_full(sent.shape, math.nan)
    if factor == 1:  # honest, bit for bit (an attack of another kind)
        return trained
    return sent.clone() if factor == 0 else sent + factor * (trained - sent)


def _protocol():
    from florist.common import protocol

    return protocol
