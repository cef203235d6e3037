"""florist's ClientApp: one thin handler per message type; the work lives in the
per-algorithm modules (`client/fedavg.py`, `client/local.py`, ...)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from florist.client import fedattn, fedavg, knnper, local, pefll, perfedckt
from florist.client.deadline import deadline
from florist.client.node import Node, node_of
from florist.common import data, packing, protocol, training
from florist.common.models import build_model


def info(node: Node) -> RecordDict:
    """Who this node is and what data it holds, so the server can plan the run."""
    d = node.data
    return protocol.content(
        config={"node-key": node.key, "input-shape": list(d.input_shape)},
        metrics={"num-train": len(d.x_train), "num-val": len(d.x_val), "num-test": len(d.x_test),
                 "seen": int(node.seen), "labelled": int(d.labelled)},
    )  # fmt: skip


def frame(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """The outermost mod, around every message and every other mod: unpack the request
    (`common/packing.py`) and pack the reply the same way, stop the work at the message's
    deadline (`client/deadline.py`), and report how long it took."""
    start = time.perf_counter()
    # Replies to florist's own message types (`category.action`) always go packed; Flower's
    # standard ones (`train`, `evaluate`, `query`) only if their request came packed.
    packed = packing.is_packed(msg.content) or "." in msg.metadata.message_type
    msg.content = packing.unpack(msg.content, "the server's message")
    with deadline(msg):
        reply = call_next(msg, context)
    if reply.has_content():
        # Beside the `metrics` record, not in it: Flower's strategies expect exactly one MetricRecord.
        reply.content[protocol.TIMING] = ConfigRecord({"handler-seconds": time.perf_counter() - start})
        reply.content = packing.pack(reply.content) if packed else reply.content
    return reply


def build_client_app(mods: Sequence[Callable] = ()) -> ClientApp:
    """The ClientApp; `mods` are Flower mods, run inside `frame` (e.g. for tests that inject failures)."""
    app = ClientApp(mods=[frame, *mods])

    def handle(work: Callable[[Node, Message, Context], RecordDict]) -> Callable[[Message, Context], Message]:
        def handler(msg: Message, context: Context) -> Message:
            torch.set_num_threads(1)  # one core per simulated client; deterministic kernels
            return Message(work(node_of(msg, context), msg, context), reply_to=msg)

        return handler

    app.query("info")(handle(lambda node, msg, ctx: info(node)))
    app.train()(handle(lambda node, msg, ctx: fedavg.train(node, msg.content)))
    app.evaluate()(handle(lambda node, msg, ctx: fedavg.evaluate(node, msg.content)))
    app.train("local")(handle(lambda node, msg, ctx: local.train(node, ctx.state)))
    app.evaluate("local")(handle(lambda node, msg, ctx: local.evaluate(node, ctx.state, msg.content)))
    app.evaluate("knnper")(handle(lambda node, msg, ctx: knnper.evaluate(node, msg.content)))
    app.query("describe")(handle(lambda node, msg, ctx: pefll.describe(node, msg.content, ctx.state)))
    app.train("generated")(handle(lambda node, msg, ctx: pefll.train(node, msg.content)))
    app.train("encoder")(handle(lambda node, msg, ctx: pefll.backprop(node, msg.content, ctx.state)))
    app.evaluate("generated")(handle(lambda node, msg, ctx: pefll.evaluate(node, msg.content)))
    app.train("ckt")(handle(lambda node, msg, ctx: perfedckt.train(node, msg.content, msg.metadata.run_id)))
    app.evaluate("ckt")(handle(lambda node, msg, ctx: perfedckt.evaluate(node, msg.content, msg.metadata.run_id)))
    app.train("attn")(handle(lambda node, msg, ctx: fedattn.train(node, msg.content)))
    app.query("represent")(handle(lambda node, msg, ctx: fedattn.describe(node, msg.content)))
    return app


def warm_up() -> None:
    """Pay the first-use costs of a ClientApp process once (the warm executor calls this before
    it forks a child per message, `deploy/executor.py`): importing the partitioners and
    scikit-learn, loading the digits, torch's first training steps (its first optimizer imports
    torch._dynamo): 5-7 s of CPU on a 2-core machine. With one torch thread, none of it starts
    a thread."""
    import datasets  # noqa: F401  (partitions of a new run are computed in the children)
    import flwr_datasets.partitioner  # noqa: F401

    torch.set_num_threads(1)
    x, y = data.load_digits()
    model = build_model("cnn", x.shape[1:], data.DIGITS_CLASSES)
    training.train(model, x[:32], y[:32], batch_size=16, lr=0.1)
    training.predict_proba(model, x[:8])


app = build_client_app()
