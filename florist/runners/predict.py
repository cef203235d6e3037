"""`florist predict`: a node's kept model (`client/personal.py`) applied to samples, the way
the run's evaluation applied it, so that on the node's test split it scores exactly the
accuracy the run reported.

Samples come from a file or folder a user names (`read`: an .npz, one image, or a data folder
as `florist join --data-dir` reads it, whose test split is taken) or from the node's own splits
rebuilt from the model's manifest (`own_split`). `predict` scores them and `write` saves the
rows as CSV or JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from florist.apps.client import PREDICTORS
from florist.client.personal import Kept
from florist.common import data as data_lib
from florist.common import folders, training
from florist.common.storage import atomic_write
from florist.config import RunConfig

FORMATS = (".csv", ".json")


def probabilities(kept: Kept, x: np.ndarray, source: str = "samples") -> np.ndarray:
    """Class probabilities (N×C) of the kept model for samples `x` (N×input shape), on the CPU;
    samples of another shape are refused in one line naming `source`."""
    if tuple(x.shape[1:]) != kept.input_shape:
        m = kept.manifest
        raise ValueError(
            f"{source}: samples of shape {tuple(x.shape[1:])}, but the model of node "
            f"{m['node_key']} (run {m['run_id']}, {m['model']}) expects {kept.input_shape}"
        )
    model = kept.network()
    predictor = PREDICTORS.get(kept.manifest["strategy"])
    return predictor(kept, model, x) if predictor else training.predict_proba(model, x)


@dataclasses.dataclass(frozen=True)
class Samples:
    """Samples to predict, their labels when known, and where they came from (for messages)."""

    x: np.ndarray
    y: np.ndarray | None
    source: str
    note: str = ""  # what a user should know about them (a node's data changed since the run)
    files: list[str] | None = None  # the image file of each sample, where they came from files


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The kept model's probabilities for `samples` (N×C), and its score where labels are known."""

    kept: Kept
    samples: Samples
    probs: np.ndarray

    @property
    def classes(self) -> np.ndarray:
        return self.probs.argmax(1)

    @property
    def correct(self) -> int | None:
        y = self.samples.y
        return None if y is None else int((self.classes == y).sum())

    @property
    def accuracy(self) -> float | None:
        """As the run computed it (the mean of the hits), so equal to results.json's to the last digit."""
        y = self.samples.y
        return None if y is None else float((self.classes == y).mean())


def own_split(kept: Kept, split: str) -> Samples:
    """Split `split` of the node's own data, rebuilt from the manifest exactly as its handlers saw
    it (`client/node.py`'s `node_data`); a note when it no longer is the data the run scored."""
    from florist.client.node import node_data

    manifest = kept.manifest
    d = node_data(manifest["node_config"], RunConfig.from_mapping(manifest["run_config"]))
    splits = {"train": (d.x_train, d.y_train), "val": (d.x_val, d.y_val), "test": (d.x_test, d.y_test)}
    if split not in splits:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(splits)}")
    x, y = splits[split]
    source = f"node {manifest['node_key']}'s {split} split"
    note = ""
    then = manifest.get("data", {}).get(split)
    if then is not None and data_lib.fingerprint(x) != then:
        note = f"{source} is not the data the run scored (fingerprint {data_lib.fingerprint(x)}, then {then})"
    return Samples(x, y, source, note)


def run_config(kept: Kept) -> RunConfig:
    """The kept model's run config as its node saw it (the node's own overrides applied): samples
    to predict are decoded as the run decoded them (image-size, skip-bad-images), and a data
    folder is split as the node split it (seed, val- and test-fraction)."""
    m = kept.manifest
    return RunConfig.from_mapping(m["run_config"]).for_node(m["node_config"])


def read(path: str | Path, num_classes: int, cfg: RunConfig | None = None) -> Samples:
    """Samples from `path`: an .npz (array x, optional y), one image, or a data folder as `florist
    join --data-dir` reads it (its test split: test.npz, or as the node splits train/ and test/,
    by `cfg`; a test/ alone whole), else a folder of images (class folders, labelled, or loose
    images), all of them; images decoded as `cfg` says (`run_config`)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    cfg = cfg or RunConfig()
    images = folders.ImageOptions.of(cfg)
    where = Path(path).expanduser()
    if where.is_dir():
        if (where / "test.npz").exists() or (where / "train.npz").exists():
            where = where / "test.npz"
        elif (where / "train").is_dir():  # the test split its node has (labels numbered over both trees)
            data = folders.folder_client(where, num_classes, cfg.seed, cfg.val_fraction, images, cfg.test_fraction)
            return Samples(data.x_test, data.y_test, f"{where}'s test split")
        elif (where / "test").is_dir():  # a test/ alone: all of it
            return _image_files(where / "test", num_classes, images)
        else:
            return _image_files(where, num_classes, images)
    elif not where.exists():
        raise FileNotFoundError(f"{where} does not exist; expected an .npz file, an image or a data folder")
    if where.suffix.lower() == ".npz":
        return Samples(*folders.read_npz(where, num_classes), str(where))
    if where.suffix.lower() in IMG_EXTENSIONS:
        return Samples(_read_image(where, num_classes, images.size), None, str(where), files=[str(where)])
    raise ValueError(f"{where}: not an .npz file, an image ({', '.join(IMG_EXTENSIONS)}) or a folder")


def _image_files(folder: Path, num_classes: int, images: folders.ImageOptions) -> Samples:
    """A folder of images (class folders, labelled, or loose), each sample named by its file."""
    x, y, _, files = folders.image_folder(folder, num_classes, images)
    return Samples(x, y, str(folder), files=files)


def _read_image(file: Path, num_classes: int, size: tuple[int, int] | None) -> np.ndarray:
    """One image as a batch of one, as `florist join` reads a folder's images (resized to `size`)."""
    from PIL import Image

    decoder = folders.ImageDecoder(str(file), folders.ImageOptions(size))
    decoder.add(0, str(file), lambda: Image.open(file))
    if decoder.bad:  # why, as a run says it (truncated, not an image)
        raise ValueError(f"{file}: {decoder.bad[0][1]}")
    return folders.check_arrays(str(file), decoder.stack()[0], None, num_classes)[0]


def predict(kept: Kept, samples: Samples) -> Prediction:
    """The kept model's prediction for `samples`."""
    return Prediction(kept, samples, probabilities(kept, samples.x, samples.source))


def check_out(out: str | Path) -> Path:
    """Where `write` may put the rows: a .csv or .json file (checked before any work is done)."""
    path = Path(out).expanduser()
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"--out {out}: expected a file ending in {' or '.join(FORMATS)}")
    if path.is_dir():
        raise ValueError(f"--out {out} is a folder; expected a .csv or .json file")
    return path


def csv_lines(prediction: Prediction) -> list[str]:
    """`index,class,class_name,p_0,...,p_{C-1}`: a header and one row per sample, probabilities to
    6 decimals; samples read from image files have their file after the index (`index,file,...`)."""
    files, names = prediction.samples.files, prediction.kept.class_names
    header = ",".join(["index", *(["file"] if files else []), "class", "class_name"])
    header += "," + ",".join(f"p_{c}" for c in range(prediction.probs.shape[1]))
    rows = (
        f"{i},{_csv_field(files[i]) + ',' if files else ''}{c},{_csv_field(names[c])},"
        + ",".join(f"{p:.6f}" for p in probs)
        for i, (c, probs) in enumerate(zip(prediction.classes.tolist(), prediction.probs, strict=True))
    )
    return [header, *rows]


def _csv_field(text: str) -> str:
    """`text` as one CSV field: quoted where a comma, quote or line break would split it."""
    return '"' + text.replace('"', '""') + '"' if any(c in text for c in ',"\n\r') else text


def describe(kept: Kept) -> dict[str, Any]:
    """Which model predicted: what the manifest says of it, and where it is."""
    m = kept.manifest
    keys = ("node_key", "strategy", "run_id", "round", "model")
    return {k: m.get(k) for k in keys} | {"reported_accuracy": m.get("accuracy"), "folder": str(kept.folder)}


def as_json(prediction: Prediction) -> dict[str, Any]:
    """Every sample's class, its name and probabilities (and label), the model and the score, exactly."""
    y, files, names = prediction.samples.y, prediction.samples.files, prediction.kept.class_names
    rows = [
        {"index": i, **({"file": files[i]} if files else {}), "class": c, "class_name": names[c], "probabilities": p}
        | ({} if y is None else {"label": int(y[i])})
        for i, (c, p) in enumerate(
            zip(prediction.classes.tolist(), prediction.probs.astype(float).tolist(), strict=True)
        )
    ]
    return {
        "model": describe(prediction.kept),
        "class_names": prediction.kept.class_names,
        "data": prediction.samples.source,
        "samples": len(rows),
        "correct": prediction.correct,
        "accuracy": prediction.accuracy,
        "predictions": rows,
    }


def write(prediction: Prediction, out: Path) -> Path:
    """The rows as `out`'s suffix says: CSV (`csv_lines`) or JSON (`as_json`)."""
    out = check_out(out)
    if out.suffix.lower() == ".json":
        text = json.dumps(as_json(prediction), indent=1)
    else:
        text = "\n".join(csv_lines(prediction))
    try:
        return atomic_write(out, lambda f: f.write((text + "\n").encode()), shared=True)
    except OSError as err:
        raise OSError(f"--out {out}: cannot write it ({err.strerror or err})") from None
