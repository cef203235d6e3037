"""The app a warm executor preloaded, and whether an app bundle is that app: the same project,
version and components, every one of its package's files byte for byte (a task of any other
bundle runs in Flower's stock process)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import pkgutil
import tomllib
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
    bundle_hash: str | None = None  # of the app bundle built from the checkout it was imported from

    @classmethod
    def load(cls, ref: str) -> PreloadedApp:
        """Import every module of the app's package now, so that no child ever reads a file of
        it that may have changed since, and fingerprint those files. If the app's module has a
        `warm_up()` function, it runs once here (it must start no thread)."""
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
        return dataclasses.replace(app, bundle_hash=app.own_bundle_hash(root.parent))

    def own_bundle_hash(self, checkout: Path) -> str | None:
        """The hash of the bundle `flwr run` builds from the checkout the app was imported from,
        if there is one and it holds exactly the preloaded app: a task of that bundle is served
        warm from its first message, before this machine has installed the bundle."""
        if not (checkout / "pyproject.toml").is_file() or not flower_internals.fast_path():
            return None  # installed as a package, not run from a checkout; or Flower's bundling unchecked
        import io
        import tempfile
        import zipfile

        fab = flower_internals.fab_bytes(checkout)
        with tempfile.TemporaryDirectory() as unpacked:
            zipfile.ZipFile(io.BytesIO(fab)).extractall(unpacked)
            ours = all(self.mismatch(Path(unpacked), component) is None for component in ("clientapp", "serverapp"))
            return hashlib.sha256(fab).hexdigest() if ours else None

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
