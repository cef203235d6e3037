"""florist's apps; a node with node config `fault="raise@R"` or `fault="hang@R"` fails its
`train` message of round R that way. Every handled message prints the torch thread count it
ran with (the warm executor's child sets it after the fork)."""

import time

import torch
from flwr.app import Context, Message

from florist.apps.client import build_client_app
from florist.apps.server import app as server
from florist.client.messages import warm_up


def fault(msg: Message, context: Context, call_next) -> Message:
    kind, _, server_round = str(context.node_config.get("fault", "")).partition("@")
    config = msg.content.config_records.get("config", {})
    if kind and msg.metadata.message_type == "train" and str(config.get("server-round")) == server_round:
        if kind == "raise":
            raise RuntimeError("injected fault")
        time.sleep(3600)  # hangs until its message's deadline stops it
    reply = call_next(msg, context)
    print(f"faultyapp: {msg.metadata.message_type} ran with {torch.get_num_threads()} torch threads", flush=True)
    return reply


client = build_client_app(mods=[fault])
__all__ = ["client", "server", "warm_up"]  # warm_up: the warm executor runs it before forking
