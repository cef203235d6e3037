"""The name of each class a model predicts, so that a prediction can be traced (issue 54): a data
folder's class sub-folders (numbered as `folders.labels` numbers them: sorted over train/ and
test/), an embedded dataset's digits. Data that names no classes (.npz files, Synthetic(α, β),
a Hugging Face id, unlabeled images) gets none: its classes are their numbers."""

from __future__ import annotations

from pathlib import Path

from florist.common.data import EMBEDDED_SHAPES


def named(dataset: str, num_classes: int, data_dir: str | Path | None = None) -> list[str] | None:
    """The names of classes 0..num_classes-1 of a node's `data_dir` (its own folder) or else of
    the run's `dataset`; a class past those the data names is its number; None when none is named."""
    if data_dir is not None:
        names = of_folder(Path(data_dir).expanduser())
    elif dataset in EMBEDDED_SHAPES:
        names = [str(c) for c in range(10)]  # the digit each class is
    else:
        folder = Path(dataset).expanduser()
        names = of_folder(folder) if dataset and folder.is_dir() else None
    if not names:
        return None
    return numbered(names[:num_classes], num_classes)


def source_of(dataset: str, data_dir: str | Path | None = None) -> str:
    """Where a node's data comes from, as its discovery reply tells the server: an embedded name,
    a synthetic spec or a Hugging Face id as given; a local folder (its `data_dir` or a folder
    `dataset`) by its last name only, since a node's paths are its own (its key hides them too)."""
    if data_dir is not None:
        return f"folder {Path(str(data_dir)).expanduser().absolute().name}"
    folder = Path(dataset).expanduser()
    return f"folder {folder.absolute().name}" if dataset and folder.is_dir() else dataset


def relative(name: str, root: str | Path) -> str:
    """A bad file's `name` as a report shows it: relative to the data's `root` where it lies under it."""
    folder = Path(str(root)).expanduser()
    for base in (folder.absolute(), folder.resolve()):
        if Path(name).is_relative_to(base):
            return str(Path(name).relative_to(base))
    return name


def numbered(names: list[str] | None, num_classes: int) -> list[str]:
    """`names` padded to `num_classes` with the classes' numbers (all numbers without names)."""
    names = list(names or [])
    return names + [str(c) for c in range(len(names), num_classes)]


def of_folder(root: Path) -> list[str] | None:
    """The class folders of an image tree as `florist join --data-dir` reads it (train/ and test/,
    or the folder itself), sorted as its labels are numbered; None for .npz files or loose images."""
    if not root.is_dir() or (root / "train.npz").exists():
        return None
    trees = [tree for tree in (root / "train", root / "test") if tree.is_dir()] or [root]
    return sorted({d.name for tree in trees for d in tree.iterdir() if d.is_dir()}) or None
