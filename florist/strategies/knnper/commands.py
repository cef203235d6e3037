"""kNN-Per's own command, `florist datastore add`: new local samples into a node's datastore
and its kept model's, without retraining the global model. Only argparse at import: the
handler imports the client half (torch, FAISS) when it runs."""

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
        help="embed a folder's labelled train samples and add them to the datastore and the kept model",
        description="Embed the labelled samples of --data-dir's train split and add them, under the run's "
        "knn-capacity and knn-policy, to the node's datastore (embedded with the global model it was built with; "
        "the node's next kNN-Per evaluation uses them) and to the store of its kept kNN-Per model (embedded with "
        "that model's network; `florist predict` and `florist export` use them at once). The folder's test split "
        "is never added (test points in the datastore would find themselves). No training, no connection.",
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
    add.add_argument(
        "--models-root",
        help="where the node keeps its models, if not in --state-dir (a simulate or compare run's RESULTS_DIR/nodes)",
    )
    add.add_argument(
        "--run-id",
        type=int,
        help="the run whose kept model to grow (default: the latest kNN-Per model the node keeps)",
    )
    add.set_defaults(func=datastore_add)


def datastore_add(args: argparse.Namespace) -> int:
    from florist.client.state import NodeState
    from florist.strategies.knnper.client import add_samples, kept_knnper
    from florist.strategies.knnper.spec import KNNPER

    state = NodeState(args.state_dir, args.node_key, KNNPER.name)
    kept = kept_knnper(args.models_root or args.state_dir, args.node_key, args.run_id)
    grown = {g.name: g for g in add_samples(state, args.data_dir, kept)}
    said = []
    if "datastore" in grown:
        said.append(f"state datastore: {grown['datastore'].before} -> {grown['datastore'].after} entries")
    else:
        said.append(f"no state datastore in {state.folder / state.namespace} (the node's next evaluation builds it)")
    if "kept" in grown:
        run = grown["kept"].kept.manifest["run_id"]
        said.append(f"kept model of run {run}: {grown['kept'].before} -> {grown['kept'].after} entries")
    else:
        said.append("no kept kNN-Per model (keep-models = 0, or none evaluated yet)")
    print(f"node {args.node_key}: added the train split of {args.data_dir} (never its test split): {'; '.join(said)}")
    return 0
