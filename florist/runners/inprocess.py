"""A federation in this process: florist's ServerApp loop drives the ClientApp's handlers by
direct calls, with no Ray, no SuperLink and no threads. Strategy tests run a round in tens of
milliseconds of overhead this way, and see every byte the real runtimes would carry: records
are serialized to Flower's protobuf and back in both directions."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto

from florist.common import devices
from florist.common.flower_internals import assign_message_id, server_identity
from florist.config import RunConfig


def _copy(records: RecordDict) -> RecordDict:
    return recorddict_from_proto(recorddict_to_proto(records))


class InProcessGrid:
    """The Grid calls florist's server makes (node ids, push, pull) and Flower's strategies'
    `start` makes (node ids, send and receive), answered at once by calling the ClientApp. A
    handler that raises gives an error reply, as Flower's runtimes do."""

    in_process = True  # the server's exchanges send it messages in batches (`exchange.LOCAL_CHUNK`)

    def __init__(
        self,
        client_app: ClientApp,
        node_configs: Iterable[dict[str, Any]],
        run_id: int | None = None,
        run_config: dict[str, Any] | None = None,
        cpus_per_client: float = 1.0,
    ):
        """`run_id`: random unless given, as Flower's are (nodes key their run's state by it);
        `run_config`: what every node's context carries, as `flwr run --run-config` gives it;
        `cpus_per_client`: the cores each client's handler may use (one runs at a time), as
        Ray's resources are in a simulation."""
        self.app, self.run_id = client_app, random.getrandbits(63) if run_id is None else run_id
        self.cpus_per_client = cpus_per_client
        self.contexts = {
            100 + i: Context(
                run_id=self.run_id,
                node_id=100 + i,
                node_config=dict(c),
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for i, c in enumerate(node_configs)
        }
        self.replies: dict[str, Message] = {}

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            ids.append(assign_message_id(msg))  # what the SuperLink does
            self.replies[ids[-1]] = self._answer(msg)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self.replies.pop(i) for i in message_ids if i in self.replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        """Every reply at once (each message is answered when pushed, so `timeout` never bites)."""
        return self.pull_messages(self.push_messages(messages))

    def _answer(self, msg: Message) -> Message:
        received = Message(_copy(msg.content), metadata=msg.metadata)  # the client's own copy, as sent
        try:
            with devices.client_cpus(self.cpus_per_client):
                reply = self.app(received, self.contexts[msg.metadata.dst_node_id])
        except Exception as err:
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(err).__name__}: {err}"), reply_to=msg)
        if reply.has_content():  # a mod's error reply has none
            reply.content = _copy(reply.content)
        return reply


def run_in_process(
    cfg: RunConfig, num_nodes: int, client_app: ClientApp | None = None, on_round=None, cpus_per_client: float = 1.0
) -> dict[str, Any]:
    """Run `cfg` on `num_nodes` embedded-digits partitions in this process; return the parsed
    results.json (the same file `florist simulate` writes). One client runs at a time, its
    torch on `cpus_per_client` threads (unless `torch-threads` says otherwise), as a
    simulated client with those CPUs would."""
    from florist.apps.client import app as default_client_app
    from florist.apps.server import run

    # The user's own clients, on this machine: they trust its server (client/guard.py).
    nodes = [{"partition-id": i, "num-partitions": num_nodes, "trusted-server": True} for i in range(num_nodes)]
    grid = InProcessGrid(client_app or default_client_app, nodes, cpus_per_client=cpus_per_client)
    with server_identity(grid.run_id):
        run(grid, cfg, on_round, grid.run_id)  # type: ignore[arg-type]  (the Grid calls florist makes)
    return json.loads((Path(cfg.results_dir).expanduser() / "results.json").read_text())
