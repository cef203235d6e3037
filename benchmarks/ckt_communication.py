"""Bytes per client and training round, PerFed-CKT against FedAvg, for the digits CNN and for
MobileNetV2 (about 2.2M parameters) on 3×32×32 digits upscaled from the same 8×8 images.

    python benchmarks/ckt_communication.py [--clusters 3] [--public-size 200]

Both sides are measured on real messages, serialized as Flower puts them on the wire: PerFed-CKT's
request is the server's (settings + c centroids on P) and its reply comes from a real client that
trains its model (τ = 2 steps here) and returns its soft decisions on P; FedAvg's are the model
down and the model up, as FedAvg's server half builds them.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import florist.apps.registry  # noqa: F401  (hands the run config its strategies)
from florist.client.node import Node, Request
from florist.client.state import NodeState
from florist.common import data as data_lib
from florist.common import protocol
from florist.common.protocol import message_config
from florist.config import RunConfig
from florist.strategies.fedavg.server import exchange_bytes
from florist.strategies.fedavg.spec import TRAIN
from florist.strategies.perfedckt import client as ckt_client
from florist.strategies.perfedckt.server import PerFedCKT
from florist.strategies.perfedckt.spec import TRAIN_CKT, PublicSettings


def upscaled(x: np.ndarray) -> np.ndarray:
    """8×8 grayscale digits as 3×32×32 images (bilinear, the gray copied to each channel)."""
    return F.interpolate(torch.from_numpy(x), size=32, mode="bilinear").repeat(1, 3, 1, 1).numpy()


def measure(model: str, big: bool, clusters: int, public_size: int, folder: Path) -> dict[str, float]:
    """One PerFed-CKT exchange and one FedAvg exchange for `model`, in bytes."""
    convert = upscaled if big else (lambda x: x)
    public_dir = folder / f"public-{model}"
    public_dir.mkdir()
    np.savez(public_dir / "public.npz", x=convert(data_lib.embedded_public(public_size, 1)))
    cfg = RunConfig.from_mapping(
        {
            "strategy": "perfed-ckt",
            "model": model,
            "public-dir": str(public_dir),
            "ckt-clusters": clusters,
            "ckt-steps": 2,
        }
    )
    x, y = data_lib.load_digits()
    own = data_lib.partition_indices("iid", 20, 1, 10, public_size)[0][:64]  # 64 samples: no batch of one
    client = data_lib.ClientData(
        convert(x[own]), y[own], convert(x[own[:8]]), y[own[:8]], convert(x[own[:8]]), y[own[:8]], 10
    )
    strategy = PerFedCKT(cfg, None, client.input_shape, 10)
    strategy.centroids = np.random.default_rng(0).normal(size=(clusters, *strategy.soft_shape)).astype(np.float32)
    request = strategy.ckt_request(TRAIN_CKT, 2, True)
    key = f"bench-{model}"
    node = Node(key, True, 1, 2, cfg, client, NodeState(folder / "state", key, cfg.strategy), {"model": model})
    reply = ckt_client.train(node, Request(PublicSettings(public_hash=strategy.public_hash), request))
    fedavg_up, fedavg_down = exchange_bytes(strategy.new_model(), message_config(cfg, TRAIN, 2, 0))
    params = sum(p.numel() for p in strategy.new_model().parameters())
    return {
        "params": params,
        "ckt": protocol.nbytes(request) + protocol.nbytes(reply),
        "fedavg": fedavg_up + fedavg_down,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clusters", type=int, default=3, help="c, the centroids sent down (default: 3)")
    parser.add_argument("--public-size", type=int, default=200, help="|P| (default: 200)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"|P| = {args.public_size}, C = 10, c = {args.clusters}; bytes per client and training round (up + down)\n")
    print("| model | input | parameters | FedAvg | PerFed-CKT | FedAvg / PerFed-CKT |")
    print("|---|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for model, big in (("cnn", False), ("mobilenet_v2", True)):
            m = measure(model, big, args.clusters, args.public_size, Path(tmp))
            shape = "3×32×32" if big else "1×8×8"
            print(
                f"| {model} | {shape} | {m['params']:,} | {m['fedavg']:,} | {m['ckt']:,} "
                f"| {m['fedavg'] / m['ckt']:,.0f}× |"
            )


if __name__ == "__main__":
    main()
