"""`florist predict`: each sample's class and probabilities from a node's kept model, the
model its run scored (kNN-Per with its datastore), and the accuracy where the data has labels.

The rows are the output (stdout, or --out as CSV or JSON); which model predicted and the
accuracy are for the person reading, on stderr, so `florist predict ... > rows.csv` keeps
only rows."""

from __future__ import annotations

import argparse
import sys

from florist.cli import options

SPLITS = ("train", "val", "test")  # as runners/predict.py's, without importing torch for --help


def add(sub: argparse._SubParsersAction) -> None:
    predict = sub.add_parser(
        "predict",
        help="classify samples with a node's personalized model (kept by its last run)",
        description="Apply the model a node kept from a run (the one its evaluation scored: kNN-Per with its "
        "datastore, PeFLL's generated weights, ...) to samples. Prints `index,class,p_0,...` CSV rows "
        "(`index,file,class,...` for image files; or writes them with --out), and on stderr which model it used "
        "and, when the samples have labels, `accuracy: A (K of N samples)` last. On the node's own test split "
        "(--split test) that is the accuracy the run reported.",
    )
    options.kept_model(predict)
    data = predict.add_mutually_exclusive_group(required=True)
    data.add_argument(
        "--data",
        type=options.path,
        metavar="PATH",
        help="samples: an .npz (array x, optional y), one image (png, jpg, ...), or a data folder as `florist join "
        "--data-dir` reads it, of which its test split (test.npz or test/) is predicted; a folder with neither: its "
        "images (an ImageFolder tree, labelled, or loose images)",
    )
    data.add_argument(
        "--split",
        choices=SPLITS,
        help="the node's own split, rebuilt as the run saw it (its data folder or partition, from the model's "
        "manifest); test is what the run scored (kNN-Per's train and val are in its store: each sample finds itself)",
    )
    predict.add_argument(
        "--out",
        metavar="FILE",
        help="write the rows to FILE.csv (index,class,p_0,...; images: index,file,class,...) or FILE.json (the model, "
        "every sample's file where it has one, class, "
        "probabilities and label, the exact accuracy) instead of printing them",
    )
    predict.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from florist.client import personal
    from florist.runners import predict as runner

    out = runner.check_out(args.out) if args.out else None  # a wrong suffix before any work
    kept = personal.locate(args.state_dir, args.node_key, args.run_id, args.model)
    if args.split:
        samples = runner.own_split(kept, args.split)
    else:  # decoded as the run decoded the node's images
        samples = runner.read(args.data, kept.num_classes, runner.run_config(kept))
    prediction = runner.predict(kept, samples)
    written = runner.write(prediction, out) if out else None  # a failure is one line: nothing is printed before it
    print(model_line(runner.describe(kept)), file=sys.stderr)
    if samples.note:
        print(f"note: {samples.note}", file=sys.stderr)
    if written is None:
        print("\n".join(runner.csv_lines(prediction)), flush=True)
    else:
        print(f"{written}: {len(samples.x)} predictions of {samples.source}", file=sys.stderr)
    if prediction.accuracy is not None:
        print(
            f"accuracy: {prediction.accuracy:.4f} ({prediction.correct} of {len(samples.x)} samples)", file=sys.stderr
        )
    return 0


def model_line(model: dict) -> str:
    """One line: whose model, of which run and round, and what the run reported for it."""
    accuracy = model["reported_accuracy"]
    reported = "no accuracy (no test labels)" if accuracy is None else f"accuracy {accuracy:.4f}"
    return (
        f"model: node {model['node_key']}, {model['strategy']}, run {model['run_id']}, round {model['round']}, "
        f"{reported} reported by the run ({model['folder']})"
    )
