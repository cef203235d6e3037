"""Flower's client mods by name, so a deployment chooses them in its configuration instead of
in code: `client-mods="fixedclipping"` is what `DifferentialPrivacyClientSideFixedClipping`
needs on every client. Names come from the node config, else the message's config (florist's
server sends the run's), else the run config, as in `client/node.py`; a mod's `_mod` suffix
may be left out. Flower's own mods are imported on first use: the run config is checked
without them.

Below them, outside MODS, `attack`: a malicious-node mod for tests and benchmarks only."""

from __future__ import annotations

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

ATTACKS = ("none", "scale", "flip", "claim", "claim-info")
MODEL_REPLIES = ("train", "train.attn")  # the replies that carry a trained model: FedAvg's, FedAttn's
INFO = "query.info"  # discovery, where a node reports its `num-train`
HUGE = 10**12


def attack(name: str, partition_id: int = 0) -> Callable:
    """FOR TESTS AND BENCHMARKS ONLY: a client mod with which node `partition_id` rewrites its
    replies. `scale`: θ_g + 1000·Δ and `flip`: θ_g − Δ, where Δ is its honest update from the θ_g
    it received (in every reply of `MODEL_REPLIES`); `claim`: flip and claim 10¹² examples in
    those replies; `claim-info`: that, and report 10¹² training examples at discovery too;
    `none`: honest."""
    if name not in ATTACKS:
        raise ValueError(f"unknown attack {name!r}; choose from {', '.join(ATTACKS)}")

    def mod(msg, context, call_next):
        reply = call_next(msg, context)
        if name == "none" or context.node_config["partition-id"] != partition_id or not reply.has_content():
            return reply
        message_type = msg.metadata.message_type
        if message_type == INFO and name == "claim-info":
            reply.content.metric_records[_protocol().METRICS]["num-train"] = HUGE
        if message_type in MODEL_REPLIES:
            _poison(msg, reply, name)
        return reply

    return mod


def _poison(msg, reply, name: str) -> None:
    """Replace the reply's model θ with θ_g + factor·(θ − θ_g), θ_g the model `msg` sent."""
    from flwr.app import ArrayRecord

    protocol = _protocol()
    sent = msg.content.array_records[protocol.ARRAYS].to_torch_state_dict()
    trained = reply.content.array_records[protocol.ARRAYS].to_torch_state_dict()
    factor = 1000.0 if name == "scale" else -1.0
    poisoned = {k: sent[k] + factor * (v - sent[k]) if v.is_floating_point() else v for k, v in trained.items()}
    reply.content.array_records[protocol.ARRAYS] = ArrayRecord(poisoned)
    if name.startswith("claim"):
        reply.content.metric_records[protocol.METRICS]["num-examples"] = HUGE


def _protocol():
    from florist.common import protocol

    return protocol
