"""`florist export`: a node's kept model as a TorchScript file an application loads without
florist (`runners/export.py`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from florist.cli import options


def add(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser(
        "export",
        help="write a node's personalized model as TorchScript (loads with torch.jit.load, no florist)",
        description="Write the model a node kept (its latest run's, or --run-id's, or the folder --model names) to "
        "--out as model.pt, a TorchScript module: float32 samples N x input shape in (uint8 images are divided by "
        "255 inside), N x C class probabilities out, as `florist predict` computes them; kNN-Per's carries its "
        "datastore and lambda, k, sigma and kernel and searches it exactly. Beside it manifest.json: the kept "
        "model's manifest plus `export` (format, input, output).",
    )
    export.add_argument("--out", required=True, metavar="DIR", help="the folder to write model.pt and manifest.json to")
    options.kept_model(export)
    export.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from florist.client.personal import locate
    from florist.runners.export import export

    kept = locate(args.state_dir, args.node_key, args.run_id, args.model)
    done = export(kept, Path(args.out).expanduser())
    m, shape = kept.manifest, " x ".join(map(str, kept.input_shape))
    scored = "unlabeled test split" if m["accuracy"] is None else f"accuracy {m['accuracy']:.4f}"
    print(
        f"{done.module}: TorchScript, {done.module.stat().st_size / 1e6:.2f} MB, the {m['strategy']} model of node "
        f"{m['node_key']} (run {m['run_id']}, round {m['round']}, {scored}), written in {done.seconds:.1f} s"
    )
    print(
        f"{done.manifest}: its manifest; load with torch.jit.load('{done.module.name}'): float32 N x {shape} in, "
        f"N x {kept.num_classes} probabilities out"
    )
    return 0
