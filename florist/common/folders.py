"""A node's own data, and a user's public set P (public.npz or images). A node's folder
(`data-dir`) is one of the layouts `LAYOUTS` names: train.npz and test.npz (arrays x, and y when
labelled), ImageFolder trees train/ and (optionally) test/, or class folders directly in it,
the same image folder `simulate` and `compare` read (`common/hub.py`). Every problem is
reported naming the file and what was expected; the arrays come out as `data.ClientData`
holds them (uint8 images kept as they are, other numbers float32).

Images, here and in a Hugging Face or local dataset (`common/hub.py`), are decoded by one
`ImageDecoder`: resized to `image-size` when set, and a file that cannot be read or has another
size than the dataset's (`survey`: the most common one over all its files, read once from
their headers) stops the run naming it, or with `skip-bad-images` is left out and counted."""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from florist.common import splitting
from florist.common.badfiles import BadImages, refuse_all, shown
from florist.common.data import ClientData
from florist.common.settings import coerce

log = logging.getLogger(__name__)
IMAGE_SIZE_FORM = "H,W (whole pixels >= 1, e.g. 64,64) or empty (images as they are)"
TEST_FRACTION = 0.2  # a node's test share when its folder has no test set and it is given none (the run's default)
LAYOUTS = (
    "train.npz and test.npz (arrays x, and y when labelled), ImageFolder trees train/ and optionally test/ "
    "(train/<class>/*.png), or class folders directly in it (<class>/*.png)"
)


@dataclasses.dataclass(frozen=True)
class ImageOptions:
    """How images are decoded: every one resized to `size` (H, W; None keeps each as it is),
    and whether a bad file is left out and counted (`skip_bad`) rather than stopping the run."""

    size: tuple[int, int] | None = None
    skip_bad: bool = False

    @classmethod
    def of(cls, cfg) -> ImageOptions:
        """The options of a run config (`image-size`, `skip-bad-images`)."""
        return cls(parse_image_size(cfg.image_size), cfg.skip_bad_images)

    @classmethod
    def of_node(cls, node_config) -> ImageOptions:
        """A node's own options (its `--node-config` image-size and skip-bad-images): what a box
        checks its folder with before it joins."""
        size = parse_image_size(str(node_config.get("image-size", "")))
        return cls(size, coerce("skip-bad-images", node_config.get("skip-bad-images", False), bool))

    def key(self) -> dict:
        """What a decoded entry depends on (`common/datacache.py`): a changed setting decodes again."""
        return {"image-size": list(self.size or ()), "skip-bad-images": self.skip_bad}


def parse_image_size(text: str) -> tuple[int, int] | None:
    """`"H,W"` as (H, W); "" as None; a ValueError naming the form otherwise."""
    if not text.strip():
        return None
    parts = text.split(",")
    sizes = [int(p) for p in parts if p.strip().isdigit()]
    if len(parts) != 2 or len(sizes) != 2 or min(sizes) < 1:
        raise ValueError(f"image-size must be {IMAGE_SIZE_FORM}, got {text!r}")
    return sizes[0], sizes[1]


def _unreadable() -> tuple[type[BaseException], ...]:
    """What PIL raises for a file that is no image it can read (truncated, another type, too large)."""
    from PIL import Image

    return OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError


def survey(openers: Iterable[Callable]) -> dict:
    """How many images of each size ("HxW") a dataset holds and whether any is in colour, read
    from the headers of the images `openers` open (PIL reads no pixels until asked: 25 µs a
    file here). JSON as it is, so that a dataset's survey can be kept (`datacache.remembered`).
    A file it cannot read is passed over: the decoder names it."""
    sizes: collections.Counter = collections.Counter()
    colour = False
    for open_image in openers:
        try:
            with open_image() as image:
                sizes[f"{image.height}x{image.width}"] += 1
                colour = colour or image.mode != "L"  # as `image_array`: all but grayscale become RGB
        except _unreadable():
            continue
    return {"sizes": dict(sizes), "colour": colour}


def decoded_shape(found: dict, options: ImageOptions) -> tuple[int, int, int] | None:
    """The C×H×W every image of a surveyed dataset is decoded to: `options.size` or the most
    common size (`most_common_size`), in colour if any image is; None when no image was read."""
    counts = {tuple(int(v) for v in size.split("x")): n for size, n in found["sizes"].items()}
    if not counts:
        return None
    return (3 if found["colour"] else 1, *(options.size or most_common_size(counts)))


def most_common_size(counts: dict[tuple[int, int], int]) -> tuple[int, int]:
    """The (H, W) most images have; a tie goes to the larger size (the larger H, then W), so the
    choice does not depend on the order the files are listed or partitioned in."""
    return max(counts, key=lambda size: (counts[size], size))


class ImageDecoder:
    """Images decoded one by one (`add`) to uint8 C×H×W, resized to `options.size`, then stacked
    (`stack`) into one array of `shape` (C×H×W, the dataset's: `decoded_shape`; None: this
    set's own most common size, in colour if any image is). A file that cannot be read, or of
    another size, is named with its path and what was expected, or with `options.skip_bad`
    left out and counted in `skipped`. Grayscale among colour is read as colour."""

    def __init__(self, where: str, options: ImageOptions, shape: tuple[int, int, int] | None = None):
        self.where, self.options, self.shape = where, options, shape
        self.images: list[np.ndarray] = []
        self.names: list[str] = []
        self.indices: list[int] = []
        self.skipped: list[str] = []
        self.bad: list[tuple[str, str, str]] = []  # without `skip_bad`: refused together in `stack`

    def add(self, index: int, name: str, open_image: Callable) -> None:
        """Decode sample `index`, the image `open_image()` opens (`name`: its path)."""
        try:
            with open_image() as image:
                array = image_array(image)
        except _unreadable() as err:
            return self._bad(name, f"cannot be read as an image ({err})", "replace or remove the file")
        if self.options.size and array.shape[1:] != self.options.size:
            import torch
            from torchvision.transforms.functional import resize

            array = resize(torch.from_numpy(array), list(self.options.size), antialias=True).numpy()
        self.images.append(array)
        self.names.append(name)
        self.indices.append(index)

    def stack(self) -> tuple[np.ndarray, np.ndarray]:
        """(N×C×H×W uint8 of the images kept, the `index` each was added with)."""
        colour = self.shape[0] == 3 if self.shape else any(a.shape[0] == 3 for a in self.images)
        images = [np.repeat(a, 3, axis=0) if colour and a.shape[0] == 1 else a for a in self.images]
        expected = self.shape
        if expected is None and images:
            sizes = collections.Counter(a.shape[1:] for a in images)
            expected = (3 if colour else 1, *most_common_size(sizes))
        keep = []
        for i, array in enumerate(images):
            if array.shape == expected:
                keep.append(i)
            else:
                why = f"is {_size(array.shape)} where the most common size is {_size(expected)}"
                self._bad(self.names[i], why, f"set image-size={expected[1]},{expected[2]} to resize every image")
        if self.bad:
            raise BadImages(self.bad)
        if self.skipped:
            log.warning(
                "%s: skipped %d bad image files (skip-bad-images): %s",
                self.where,
                len(self.skipped),
                shown(self.skipped),
            )
        if not keep:
            raise ValueError(f"{self.where}: no readable image (skipped {len(self.skipped)} bad files)")
        return np.stack([images[i] for i in keep]), np.asarray([self.indices[i] for i in keep], dtype=np.int64)

    def _bad(self, name: str, why: str, fix: str) -> None:
        (self.skipped.append(name) if self.options.skip_bad else self.bad.append((name, why, fix)))


def _size(shape: tuple[int, ...]) -> str:
    return f"{shape[1]}×{shape[2]} {'RGB' if shape[0] == 3 else 'grayscale'}"


def folder_client(
    data_dir: str | Path,
    num_classes: int,
    seed: int,
    val_fraction: float,
    images: ImageOptions = ImageOptions(),
    test_fraction: float = TEST_FRACTION,
) -> ClientData:
    """A node's own data in one of the `LAYOUTS`, decoded (`decode_folder`) and split
    (`split_folder`)."""
    return split_folder(data_dir, decode_folder(data_dir, images), num_classes, seed, val_fraction, test_fraction)


def decode_folder(data_dir: str | Path, images: ImageOptions = ImageOptions()) -> ClientData:
    """A node's folder decoded (with `images`, to one shape for train and test: `survey`) and
    not yet split: `x_train` holds every training sample, `x_test` the folder's own test set
    (None without one), no validation. What the run's seed, fractions and classes change is
    left to `split_folder`, so a node decodes (and caches) its folder once per image options,
    whatever a server sends. Every problem is reported with the file it was found in."""
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"data-dir {str(root)!r} does not exist or is not a folder; expected {LAYOUTS}")
    if (root / "train.npz").exists():
        return ClientData(*read_npz(root / "train.npz"), None, None, *read_npz(root / "test.npz"), num_classes=0)
    trees = _trees(root)
    listed = [image_files(tree) for tree in trees]
    shape = decoded_shape(survey(_opener(f) for files, _ in listed for f in files), images)
    ids = labels(*(classes for _, classes in listed))
    trees_ids = zip(trees, listed, ids)
    decoded = refuse_all(lambda t=t, f=f, y=y: decode_files(t, f, y, None, images, shape) for t, (f, _), y in trees_ids)
    test = decoded[1][:2] if len(decoded) == 2 else (None, None)
    skipped = tuple(name for d in decoded for name in d[4])
    return ClientData(*decoded[0][:2], None, None, *test, 0, skipped_images=len(skipped), skipped_files=skipped)


def _trees(root: Path) -> list[Path]:
    """The image trees of `root`: train/ and test/, train/ alone, or `root` itself."""
    trees = [root / "train", root / "test"] if (root / "test").is_dir() else [root / "train"]
    if trees[0].is_dir():
        return trees
    if not any(_image_or_folder(f) for f in root.iterdir()) or (root / "test").is_dir():
        what = "test/ but no train/" if (root / "test").is_dir() else "neither train.npz nor a train/ folder"
        raise FileNotFoundError(f"data-dir {str(root)!r} holds {what} (nor class folders); expected {LAYOUTS}")
    return [root]


def split_folder(
    data_dir: str | Path,
    whole: ClientData,
    num_classes: int,
    seed: int,
    val_fraction: float,
    test_fraction: float = TEST_FRACTION,
) -> ClientData:
    """`decode_folder`'s data split in memory: with a test set of its own, the validation
    split is carved out of the training set (`data.val_split`); without one (class folders
    directly in the folder, or train/ alone), validation and test both come out of it by
    `val_fraction` and `test_fraction`, as a simulated client's do (`data.split_indices`).
    Seeded with `seed`; labels checked against `num_classes`."""
    root = Path(data_dir).expanduser()
    npz = (root / "train.npz").exists()
    train_from = root / "train.npz" if npz else _trees(root)[0]
    check_labels(str(train_from), whole.y_train, num_classes)
    if whole.x_test is not None:
        check_labels(str(root / "test.npz" if npz else root / "test"), whole.y_test, num_classes)
    return splitting.split_client(train_from, whole, num_classes, seed, val_fraction, test_fraction)


def _image_or_folder(path: Path) -> bool:
    from torchvision.datasets.folder import IMG_EXTENSIONS

    return path.is_dir() or (path.is_file() and path.suffix.lower() in IMG_EXTENSIONS)


def _opener(file: str) -> Callable:
    from PIL import Image

    return lambda: Image.open(file)


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


def read_npz(path: Path, num_classes: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
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


def read_image_folder(
    path: Path, num_classes: int, options: ImageOptions = ImageOptions()
) -> tuple[np.ndarray, np.ndarray | None]:
    """An ImageFolder tree (`path/<class>/*.png`, labelled), or images directly in `path`
    (unlabeled, e.g. a node that will only be served), decoded with `options`."""
    return image_folder(path, num_classes, options)[:2]


def image_folder(
    path: Path, num_classes: int, options: ImageOptions = ImageOptions()
) -> tuple[np.ndarray, np.ndarray | None, int, list[str]]:
    """`read_image_folder`'s (x, y), how many bad files it left out (`skip-bad-images`) and the
    file of each row; decoded to its own most common size (`survey`)."""
    files, classes = image_files(path)
    shape = decoded_shape(survey(_opener(f) for f in files), options)
    return decode_files(path, files, labels(classes)[0], num_classes, options, shape)[:4]


def image_files(path: Path) -> tuple[list[str], list[str] | None]:
    """(image files, the class folder of each) of an ImageFolder tree (`path/<class>/*.png`),
    or of images directly in `path` (unlabeled: None)."""
    from torchvision.datasets import ImageFolder

    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} is missing; expected an ImageFolder tree (one folder per class) or a folder of unlabeled images"
        )
    loose = sorted(f for f in path.iterdir() if f.is_file() and _image_or_folder(f))
    if loose and not any(f.is_dir() for f in path.iterdir()):
        return [str(f) for f in loose], None
    try:
        folder = ImageFolder(str(path))
    except (FileNotFoundError, RuntimeError) as err:  # its text, a listing of the folder, stays the cause
        raise ValueError(
            f"{path} is not a valid ImageFolder tree (one sub-folder of images per class) nor a folder of "
            "images (a sub-folder without images, or files of no image type)"
        ) from err
    return [f for f, _ in folder.samples], [folder.classes[t] for t in folder.targets]


def labels(*classes: list[str] | None) -> list[np.ndarray | None]:
    """Each tree's class folders as label ids, numbered over all the trees' class names sorted
    (as torchvision numbers one tree's, and Hugging Face's imagefolder its splits'): a class
    that test/ lacks does not shift the ids of the others."""
    names = sorted({name for tree in classes if tree is not None for name in tree})
    ids = {name: i for i, name in enumerate(names)}
    return [None if tree is None else np.asarray([ids[n] for n in tree], dtype=np.int64) for tree in classes]


def decode_files(
    path: Path,
    files: list[str],
    y: np.ndarray | None,
    num_classes: int | None,
    options: ImageOptions,
    shape: tuple[int, int, int] | None,
) -> tuple[np.ndarray, np.ndarray | None, int, list[str], list[str]]:
    """(x, y, bad files left out, the file of each row, the bad files' names) of
    `image_files`' listing of `path`, decoded to `shape`."""
    decoder = ImageDecoder(str(path), options, shape)
    for index, file in enumerate(files):
        decoder.add(index, file, _opener(file))
    x, kept = decoder.stack()
    checked = check_arrays(str(path), x, None if y is None else y[kept], num_classes)
    return *checked, len(decoder.skipped), [files[i] for i in kept], decoder.skipped


def image_array(image) -> np.ndarray:
    """A PIL image as C×H×W uint8: grayscale stays one channel (digits-like data), anything
    else becomes RGB."""
    from torchvision.transforms.functional import pil_to_tensor

    return pil_to_tensor(image if image.mode in ("L", "RGB") else image.convert("RGB")).numpy()


def check_arrays(
    where: str, x: np.ndarray, y: np.ndarray | None, num_classes: int | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Validate and normalise x to N×C×H×W (or N×D), uint8 images kept as they are and any
    other number as float32, and y to int64 in [0, C) (C None: checked later, `check_labels`)."""
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
    if num_classes is not None:
        check_labels(where, y, num_classes)
    return x, y.astype(np.int64)


def check_labels(where: str, y: np.ndarray | None, num_classes: int) -> None:
    """Labels `y` (None: unlabeled) are class ids in [0, num_classes)."""
    if y is None:
        return
    bad = y[(y < 0) | (y >= num_classes)]
    if len(bad):  # which labels, only in the cause: a node's log shows it, its reply to the server does not
        found = ValueError(f"{where}: labels {sorted(set(bad.tolist()))[:5]} are outside [0, {num_classes})")
        raise ValueError(
            f"{where}: the labels do not fit num-classes {num_classes} (0 to {num_classes - 1})"
        ) from found
