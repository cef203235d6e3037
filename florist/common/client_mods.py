"""Flower's client mods by name, so a deployment chooses them in its configuration instead of
in code: `client-mods="fixedclipping"` is what `DifferentialPrivacyClientSideFixedClipping`
needs on every client. Names come from the node config, else the message's config (florist's
server sends the run's), else the run config, as in `client/node.py`; a mod's `_mod` suffix
may be left out. Flower's own mods are imported on first use: the run config is checked
without them."""

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
