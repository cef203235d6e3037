"""florist's apps; a node with node config `bulk=true` adds 200 MB of float32 values (a record
of their own) to each of its `train` replies."""

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message

from florist.apps.client import build_client_app
from florist.apps.server import app as server
from florist.client.messages import warm_up

BULK = 50_000_000  # float32 values: 200 MB


def bulk(msg: Message, context: Context, call_next) -> Message:
    reply = call_next(msg, context)
    if context.node_config.get("bulk") and msg.metadata.message_type == "train" and reply.has_content():
        # Distinct values: 40 distinct chunks of 5 MB on the wire (equal ones would travel once).
        reply.content["junk"] = ArrayRecord({"x": Array(np.arange(BULK, dtype=np.float32))})
    return reply


client = build_client_app(mods=[bulk])
__all__ = ["client", "server", "warm_up"]  # warm_up: the warm executor runs it before forking
