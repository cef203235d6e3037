"""florist's ClientApp: one thin handler per message type; the work lives in the
per-algorithm modules (`client/fedavg.py`, `client/local.py`, ...)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from florist.client import fedattn, fedavg, knnper, local, pefll, perfedckt
from florist.client.node import Node, node_of
from florist.common import protocol


def info(node: Node) -> RecordDict:
    """Who this node is and what data it holds, so the server can plan the run."""
    d = node.data
    return protocol.content(
        config={"node-key": node.key, "input-shape": list(d.input_shape)},
        metrics={"num-train": len(d.x_train), "num-val": len(d.x_val), "num-test": len(d.x_test),
                 "seen": int(node.seen), "labelled": int(d.labelled)},
    )  # fmt: skip


def build_client_app(mods: Sequence[Callable] = ()) -> ClientApp:
    """The ClientApp; `mods` are Flower mods (e.g. for tests that inject failures)."""
    app = ClientApp(mods=list(mods))

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


app = build_client_app()
