"""How a node answers florist's messages: the outer mod around every message (`frame`), the
node's own `query.info` handler, and the ClientApp made of the handlers it is handed, each
`(node, request) -> reply records` (`florist/apps/client.py` hands it every strategy's)."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from florist.client import guard, ledger
from florist.client.deadline import deadline
from florist.client.node import Node, Request, node_key, parse
from florist.common import classnames, client_mods, data, devices, packing, protocol, training
from florist.common.models import build_model
from florist.common.spec import Exchange, StrategySpec


def info(node: Node, request: Request) -> RecordDict:
    """Who this node is and what data it holds, so the server can plan the run."""
    d = node.data
    return protocol.content(
        config={"node-key": node.key, "input-shape": list(d.input_shape), "device": str(node.device)} | said(node),
        metrics={
            "num-train": len(d.x_train),
            "num-val": len(d.x_val),
            "num-test": len(d.x_test),
            "seen": int(node.seen),
            "labelled": int(d.labelled),
        },
    )


def said(node: Node) -> dict[str, str | list[str]]:
    """What the node tells the server of its data, once a run (discovery), so report.md says what
    each node read: its source and class names, and the first bad files it left out, named relative
    to its folder (none under dp, where a file's name would tell of a record; its log names them)."""
    cfg, data_dir = node.cfg, node.node_config.get("data-dir")
    names = classnames.named(cfg.dataset, cfg.num_classes, data_dir)
    root = data_dir if data_dir is not None else cfg.dataset
    shown = node.data.skipped_files[: protocol.MAX_NAMED_FILES] if cfg.dp == "none" else ()
    files = [classnames.relative(f, root) for f in shown]
    return (
        {protocol.DATA_SOURCE: classnames.source_of(cfg.dataset, data_dir)}
        | ({protocol.CLASS_NAMES: names[: protocol.MAX_NAMES]} if names else {})
        | ({protocol.SKIPPED_FILES: files} if files else {})
    )


def frame(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """The outermost mod, around every message and every other mod: unpack the request
    (`common/packing.py`) and pack the reply the same way, stop the work at the message's
    deadline or the node's cap (`client/deadline.py`, `client/guard.py`), and report how long
    it took. Whatever the work raises is logged here in full and becomes an error reply that
    tells the server only a short reason (`guard.error_reply`): the node is left out as before."""
    start = time.perf_counter()
    # Replies to florist's own message types (`category.action`) always go packed; Flower's
    # standard ones (`train`, `evaluate`, `query`) only if their request came packed.
    packed = packing.is_packed(msg.content) or "." in msg.metadata.message_type
    try:
        seconds = guard.Limits.of(context.node_config).seconds(msg, f"node {node_key(context.node_config)}")
        msg.content = packing.unpack(msg.content, "the server's message")
        with deadline(msg, seconds):
            reply = call_next(msg, context)
    except Exception as err:
        return guard.error_reply(msg, err)
    if reply.has_content():
        # Beside the `metrics` record, not in it: Flower's strategies expect exactly one MetricRecord.
        timing = reply.content.config_records.get(protocol.TIMING, ConfigRecord())
        timing["handler-seconds"] = time.perf_counter() - start
        reply.content[protocol.TIMING] = timing
        if place := ray_place():
            reply.content[protocol.PLACE] = ConfigRecord(place)
        reply.content = packing.pack(reply.content) if packed else reply.content
    return reply


def ray_place() -> dict[str, str]:
    """Where this reply is made, when a Ray actor makes it (Flower's simulation): the Ray node's
    id and address, and the host's name, which the server keeps per client in results.json
    (`protocol.place_of`). Nothing elsewhere: a deployed node tells the server no more than
    its replies need. Ray is not imported for the question."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return {}
    node, ip = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    place = {"ray-node": node, "ray-node-ip": ip, "host": socket.gethostname()}
    return {key: value for key, value in place.items() if protocol.PLACE_FORMS[key].fullmatch(value)}


Handler = Callable[[Node, Request], RecordDict]


def build_client_app(
    handlers: Mapping[Exchange, Handler],
    strategies: Mapping[str, StrategySpec],
    mods: Sequence[Callable] = (),
    *,
    cls: type[ClientApp] = ClientApp,
    bounded: Collection[str] = (),
    record_bounded: Collection[str] = (),
) -> ClientApp:
    """The ClientApp answering each exchange with its handler (`strategies`: what a message's
    `strategy` may name, for its settings); `mods` are Flower mods, run inside `frame` and the
    mods `client-mods` names (e.g. for tests that inject failures). `bounded`: the message types
    a node under its own dp answers, `record_bounded` those under record-level dp (`ledger.refuse_unbounded`)."""
    app = cls(mods=[frame, client_mods.configured, *mods])
    for exchange, work in handlers.items():
        category, _, action = exchange.message_type.partition(".")
        getattr(app, category)(action or "default")(_handler(exchange, work, strategies, bounded, record_bounded))
    return app


def _handler(
    exchange: Exchange,
    work: Handler,
    strategies: Mapping[str, StrategySpec],
    bounded: Collection[str],
    record_bounded: Collection[str] = (),
) -> Callable[[Message, Context], Message]:
    def handler(msg: Message, context: Context) -> Message:
        start = time.perf_counter()
        # loads the node's data: the "data-seconds" of the reply
        node, request = parse(msg, context, exchange, strategies)
        ledger.refuse_unbounded(node, exchange.message_type, bounded, record_bounded)
        data_seconds = time.perf_counter() - start
        devices.set_torch_threads(node.cfg.torch_threads)  # in the message's process: after the warm executor's fork
        content = work(node, request)
        content[protocol.TIMING] = ConfigRecord({"data-seconds": data_seconds})
        if (book := node.record_session.get("ledger")) is not None and book.reserved:  # it took DP-SGD steps
            content[protocol.RECORD_DP] = ConfigRecord(book.report())
        return Message(content, reply_to=msg)

    handler.__name__ = work.__name__
    return handler


def warm_up() -> None:
    """Pay the first-use costs of a ClientApp process once (the warm executor calls this before
    it forks a child per message, `deploy/executor.py`): importing the partitioners and
    scikit-learn, dp-accounting, loading the digits, torch's first training steps (its first optimizer
    imports torch._dynamo): 5-7 s of CPU on a 2-core machine. With one torch thread, none of it starts
    a thread; each child sets its own count (`torch-threads`) after the fork."""
    import datasets  # noqa: F401  (partitions of a new run are computed in the children)
    import flwr_datasets.partitioner  # noqa: F401
    from dp_accounting import pld, rdp  # noqa: F401  (record-level dp's ledger: 1-2 s a message otherwise)

    torch.set_num_threads(1)
    x, y = data.load_digits()
    model = build_model("cnn", x.shape[1:], data.DIGITS_CLASSES)
    training.train(model, x[:32], y[:32], batch_size=16, lr=0.1)
    training.predict_proba(model, x[:8])
