"""A node's own data: a folder with train.npz and test.npz (arrays x, and y when labelled) or
ImageFolder trees train/ and test/, and a user's public set P (public.npz or images). Every
problem is reported naming the file and what was expected; the arrays come out as
`data.ClientData` holds them (uint8 images kept as they are, other numbers float32)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from florist.common.data import ClientData


def folder_client(data_dir: str | Path, num_classes: int, seed: int, val_fraction: float) -> ClientData:
    """A node's own data: `train.npz`/`test.npz` or ImageFolder trees `train/` and `test/`.

    The validation split is carved out of the training set with `seed`. Every problem is
    reported with the file it was found in and what was expected.
    """
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(
            f"data-dir {str(root)!r} does not exist or is not a folder; expected train.npz and "
            "test.npz (arrays x and y) or ImageFolder trees train/ and test/"
        )
    if (root / "train.npz").exists():
        x_train, y_train = read_npz(root / "train.npz", num_classes)
        x_test, y_test = read_npz(root / "test.npz", num_classes)
    elif (root / "train").is_dir():
        x_train, y_train = read_image_folder(root / "train", num_classes)
        x_test, y_test = read_image_folder(root / "test", num_classes)
    else:
        raise FileNotFoundError(
            f"data-dir {str(root)!r} holds neither train.npz nor a train/ folder; expected "
            "train.npz and test.npz (arrays x, and y when labelled) or ImageFolder trees train/ and test/"
        )
    if x_test.shape[1:] != x_train.shape[1:]:
        raise ValueError(f"{root}: test samples have shape {x_test.shape[1:]} but train samples {x_train.shape[1:]}")
    if (y_train is None) != (y_test is None):
        raise ValueError(f"{root}: train and test must both be labelled or both unlabeled")
    if len(x_train) < 2:
        raise ValueError(f"{root / 'train.npz'}: need at least 2 training samples, got {len(x_train)}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x_train))
    n_val = min(max(1, int(round(val_fraction * len(x_train)))), len(x_train) - 1)
    val, train = order[:n_val], order[n_val:]

    def take(y: np.ndarray | None, idx: np.ndarray) -> np.ndarray | None:
        return None if y is None else y[idx]

    return ClientData(
        x_train[train], take(y_train, train), x_train[val], take(y_train, val), x_test, y_test, num_classes
    )


def folder_public(public_dir: str | Path, num_classes: int) -> np.ndarray:
    """A user-supplied public set P: `public.npz` with array x (labels, if any, are not used)
    or a folder of images."""
    root = Path(public_dir).expanduser()
    if (root / "public.npz").is_file():
        return read_npz(root / "public.npz", num_classes)[0]
    if not root.is_dir():
        raise FileNotFoundError(
            f"public-dir {str(root)!r} does not exist; expected a folder holding public.npz (array x) or images"
        )
    return read_image_folder(root, num_classes)[0]


def read_npz(path: Path, num_classes: int) -> tuple[np.ndarray, np.ndarray | None]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; expected an .npz with array x (and y when labelled)")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {k: archive[k] for k in archive.files}
    except (ValueError, OSError) as err:
        raise ValueError(f"{path} is not a readable .npz of numeric arrays: {err}") from err
    if "x" not in arrays:
        raise ValueError(f"{path} has arrays {sorted(arrays)}; expected 'x' (samples) and optionally 'y' (labels)")
    return check_arrays(str(path), arrays["x"], arrays.get("y"), num_classes)


def read_image_folder(path: Path, num_classes: int) -> tuple[np.ndarray, np.ndarray | None]:
    """An ImageFolder tree (`path/<class>/*.png`, labelled), or images directly in `path`
    (unlabeled, e.g. a node that will only be served)."""
    from torchvision.datasets import ImageFolder
    from torchvision.datasets.folder import IMG_EXTENSIONS

    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} is missing; expected an ImageFolder tree (one folder per class) or a folder of unlabeled images"
        )
    loose = sorted(f for f in path.iterdir() if f.is_file() and f.suffix.lower() in IMG_EXTENSIONS)
    if loose and not any(f.is_dir() for f in path.iterdir()):
        files, y = [str(f) for f in loose], None
    else:
        try:
            folder = ImageFolder(str(path))
        except (FileNotFoundError, RuntimeError) as err:  # its text, a listing of the folder, stays the cause
            raise ValueError(
                f"{path} is not a valid ImageFolder tree (one sub-folder of images per class) nor a folder of "
                "images (a sub-folder without images, or files of no image type)"
            ) from err
        files, y = [f for f, _ in folder.samples], np.asarray(folder.targets)
    images = [_load_image(f) for f in files]
    shapes = {im.shape for im in images}
    if len(shapes) > 1:
        raise ValueError(f"{path}: images have different shapes {sorted(shapes)}; expected one size")
    return check_arrays(str(path), np.stack(images), y, num_classes)


def _load_image(file: str) -> np.ndarray:
    from PIL import Image

    with Image.open(file) as image:
        return image_array(image)


def image_array(image) -> np.ndarray:
    """A PIL image as C×H×W uint8: grayscale stays one channel (digits-like data), anything
    else becomes RGB."""
    from torchvision.transforms.functional import pil_to_tensor

    return pil_to_tensor(image if image.mode in ("L", "RGB") else image.convert("RGB")).numpy()


def check_arrays(
    where: str, x: np.ndarray, y: np.ndarray | None, num_classes: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Validate and normalise x to N×C×H×W (or N×D), uint8 images kept as they are and any
    other number as float32, and y to int64 in [0, C)."""
    if x.dtype == object or not np.issubdtype(x.dtype, np.number):
        raise ValueError(f"{where}: x must be a numeric array of equal-shaped samples, got dtype {x.dtype}")
    if x.ndim not in (2, 3, 4):
        raise ValueError(f"{where}: x has shape {x.shape}; expected N×D, N×H×W or N×C×H×W")
    if len(x) == 0:
        raise ValueError(f"{where}: the set is empty (x has 0 samples)")
    if x.dtype != np.uint8:
        x = x.astype(np.float32)
    if x.ndim == 3:
        x = x[:, None, :, :]
    if x.dtype != np.uint8 and not np.isfinite(x).all():
        raise ValueError(f"{where}: x contains NaN or Inf")
    if y is None:
        return x, None
    if y.ndim != 1 or len(y) != len(x):
        raise ValueError(f"{where}: y has shape {y.shape}; expected ({len(x)},) to match x")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"{where}: y must hold integer class labels, got dtype {y.dtype}")
    bad = y[(y < 0) | (y >= num_classes)]
    if len(bad):  # which labels, only in the cause: a node's log shows it, its reply to the server does not
        found = ValueError(f"{where}: labels {sorted(set(bad.tolist()))[:5]} are outside [0, {num_classes})")
        raise ValueError(
            f"{where}: the labels do not fit num-classes {num_classes} (0 to {num_classes - 1})"
        ) from found
    return x, y.astype(np.int64)
