"""kNN-Per's own command, `florist datastore add`: new local samples into a node's datastore,
without retraining the global model. Only argparse at import: the handler imports the client
half (torch, FAISS) when it runs."""

from __future__ import annotations

import argparse


def add(sub: argparse._SubParsersAction) -> None:
    """`datastore` and its action `add`, on the `florist` command's subparsers."""
    store = sub.add_parser(
        "datastore",
        help="manage a node's kNN-Per datastore",
        description="A node's kNN-Per datastore lives in its state folder, beside the global model it was built "
        "with. `add` appends new local samples without retraining the global model, under the run's capacity and "
        "policy (concat: keep all; fifo: keep the newest knn-capacity; fixed: keep the first knn-capacity).",
    )
    store_sub = store.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = store_sub.add_parser(
        "add",
        help="embed a folder's labelled train samples and add them to the datastore",
        description="Embed the labelled samples of --data-dir's train split with the global model the node's "
        "datastore was built with and add them to it, under the run's knn-capacity and knn-policy. The folder's "
        "test split is never added (test points in the datastore would find themselves). No training, no "
        "connection: the node's next kNN-Per evaluation uses the new entries.",
    )
    add.add_argument(
        "--data-dir",
        required=True,
        help="a node data folder (train.npz and test.npz, or ImageFolder "
        "trees train/ and test/); only its train split is added",
    )
    add.add_argument(
        "--state-dir", help="the node's state folder (node config state-dir; default ~/.cache/florist/nodes)"
    )
    add.add_argument("--node-key", required=True, help="the node's key (node config node-key, e.g. partition-3)")
    add.set_defaults(func=datastore_add)


def datastore_add(args: argparse.Namespace) -> int:
    from florist.client.state import NodeState
    from florist.strategies.knnper.client import add_samples
    from florist.strategies.knnper.spec import KNNPER

    state = NodeState(args.state_dir, args.node_key, KNNPER.name)
    before, after = add_samples(state, args.data_dir)
    print(
        f"datastore of node {args.node_key!r} ({state.folder}): {before} -> {after} entries from the train split "
        f"of {args.data_dir} (its test split is never added)"
    )
    return 0
