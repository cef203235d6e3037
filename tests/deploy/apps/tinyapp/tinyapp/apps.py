"""Every node reports its process id, `rounds` times; the server prints what it got."""

import os
import time

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

client = ClientApp()
server = ServerApp()


@client.query()
def report(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"pid": os.getpid()})}), reply_to=msg)


@server.main()
def main(grid: Grid, context: Context) -> None:
    deadline = time.monotonic() + 60
    while not (nodes := list(grid.get_node_ids())) and time.monotonic() < deadline:
        time.sleep(0.5)
    for _ in range(int(context.run_config["rounds"])):
        messages = [Message(RecordDict(), dst_node_id=node, message_type="query") for node in nodes]
        replies = list(grid.send_and_receive(messages, timeout=120))
        pids = sorted(int(r.content["metrics"]["pid"]) for r in replies if not r.has_error())
        print(f"tinyapp: {len(pids)} of {len(nodes)} nodes replied, pids {pids}", flush=True)
