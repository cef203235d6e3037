"""The app a warm executor preloaded, and the one app bundle (FAB) that is that app: the bundle
`flwr run` builds from the checkout it was imported from, known by its full sha256, holding
exactly the preloaded package's files. A task of any other bundle runs in Flower's stock process:
a bundle is code, and a warm child runs only what this process imported (a bundle with florist's
files plus a top-level `torchvision/` is another bundle)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import io
import pkgutil
import tempfile
import tomllib
import zipfile
from collections.abc import Mapping
from pathlib import Path

from florist.common import flower_internals


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclasses.dataclass(frozen=True)
class PreloadedApp:
    """The app this process imported (its whole package), and what identifies its code."""

    ref: str  # "module:attribute", as in [tool.flwr.app.components] clientapp
    package: str  # the top-level package the app lives in
    files: dict[str, str]  # "package/path.py" -> sha256, read when imported
    distribution: tuple[str, str] | None  # (project name, version) when installed as one
    bundle_hash: str | None = None  # sha256 of the app bundle built from the checkout it was imported from
    bundle_files: Mapping[str, str] = dataclasses.field(default_factory=dict)  # that bundle's files -> sha256

    @classmethod
    def load(cls, ref: str, checkout: Path | None = None) -> PreloadedApp:
        """Import every module of the app's package now, so that no child ever reads a file of
        it that may have changed since, and fingerprint those files. If the app's module has a
        `warm_up()` function, it runs once here (it must start no thread). `checkout`: where the
        app's publishable files are (default: the folder the package was imported from)."""
        package = ref.partition(":")[0].split(".")[0]
        root = Path(importlib.import_module(package).__file__).parent
        for module in pkgutil.walk_packages([str(root)], prefix=f"{package}."):
            if not module.name.endswith("__main__"):
                importlib.import_module(module.name)
        module = importlib.import_module(ref.partition(":")[0])
        functools.reduce(getattr, ref.partition(":")[2].split("."), module)  # the app exists
        if callable(warm_up := getattr(module, "warm_up", None)):
            warm_up()
        files = {p.relative_to(root.parent).as_posix(): _digest(p) for p in sorted(root.rglob("*.py"))}
        app = cls(ref, package, files, _distribution(package))
        bundle_hash, bundle_files = app.own_bundle(checkout or root.parent)
        return dataclasses.replace(app, bundle_hash=bundle_hash, bundle_files=bundle_files)

    def own_bundle(self, checkout: Path) -> tuple[str | None, dict[str, str]]:
        """(sha256, files) of the bundle `flwr run` builds from `checkout`, if it holds exactly
        the preloaded app (its package's files and components), else (None, {}): a task of that
        bundle, and of no other, is served warm, from its first message on."""
        if not (checkout / "pyproject.toml").is_file() or flower_internals.unusable("publish"):
            return None, {}  # installed as a package, not run from a checkout; or Flower's bundling differs
        fab = flower_internals.fab_bytes(checkout)
        with zipfile.ZipFile(io.BytesIO(fab)) as archive, tempfile.TemporaryDirectory() as unpacked:
            archive.extractall(unpacked)
            files = {
                name: hashlib.sha256(archive.read(name)).hexdigest()
                for name in archive.namelist()
                if not name.endswith("/") and not name.startswith(".info/")  # Flower does not install .info
            }
            ours = all(self.mismatch(Path(unpacked), component) is None for component in ("clientapp", "serverapp"))
        return (hashlib.sha256(fab).hexdigest(), files) if ours else (None, {})

    def holds(self, folder: Path) -> str | None:
        """Why `folder` (where Flower installed a bundle) does not hold exactly the preloaded app's
        bundle, every file of it and nothing else; None when it does. Bytecode in `__pycache__`
        (written there by a stock process that imported the bundle) does not count: a warm child
        never imports from the folder."""
        if not self.bundle_files:
            return "there is no bundle of the preloaded app to compare it with"
        theirs = {
            p.relative_to(folder).as_posix(): p
            for p in folder.rglob("*")
            if not p.is_dir() and "__pycache__" not in p.relative_to(folder).parts
        }
        extra = sorted(theirs.keys() - self.bundle_files.keys())
        missing = sorted(self.bundle_files.keys() - theirs.keys())
        changed = sorted(
            k for k in theirs.keys() & self.bundle_files.keys() if _digest(theirs[k]) != self.bundle_files[k]
        )
        if extra or missing or changed:
            return "; ".join(
                f"{len(names)} {what} ({', '.join(names[:3])})"
                for names, what in (
                    (extra, "files not in the bundle"),
                    (missing, "files missing"),
                    (changed, "changed"),
                )
                if names
            )
        return None

    def mismatch(self, fab_dir: Path, component: str = "clientapp") -> str | None:
        """Why the `component` ("clientapp" or "serverapp") of the app bundle installed in
        `fab_dir` is not preloaded here; None when it is."""
        try:
            config = tomllib.loads((fab_dir / "pyproject.toml").read_text())
            ref = config["tool"]["flwr"]["app"]["components"][component]
            project = (config["project"]["name"], str(config["project"]["version"]))
        except (OSError, KeyError, tomllib.TOMLDecodeError) as err:
            return f"its pyproject.toml is unreadable ({err!r})"
        if not ref.startswith(f"{self.package}."):  # every module of the package was imported
            return f"its {component} {ref!r} is not in the preloaded package {self.package}"
        if self.distribution and (_normal(project[0]), project[1]) != (
            _normal(self.distribution[0]),
            self.distribution[1],
        ):
            return f"it is {project[0]} {project[1]}, the installed package is {' '.join(self.distribution)}"
        theirs = {p.relative_to(fab_dir).as_posix(): _digest(p) for p in (fab_dir / self.package).rglob("*.py")}
        changed = sorted(k for k in theirs.keys() | self.files.keys() if theirs.get(k) != self.files.get(k))
        if changed:
            return (
                f"{len(changed)} of its {self.package} files differ from the preloaded ones ({', '.join(changed[:3])})"
            )
        return None


def _distribution(package: str) -> tuple[str, str] | None:
    """(project name, version) of the installed distribution that provides `package`
    (editable installs are not in `packages_distributions`, so try the package's own name too)."""
    for name in importlib.metadata.packages_distributions().get(package, []) + [package]:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _normal(name: str) -> str:
    return name.lower().replace("_", "-")
