"""The house stays easy to walk: no module over 400 lines, no function over 60, and each layer
imports (at module level) only the layers below it: common < strategies < config < client,
server < runners, deploy < cli."""

import ast
from pathlib import Path

import pytest

import florist

PACKAGE = Path(florist.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))
LAYERS = {"common": 0, "strategies": 1, "config": 2, "client": 3, "server": 3, "runners": 4, "deploy": 4, "cli": 5}


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def _layer(module: str) -> int | None:
    """The layer of `florist.X...` (None for the package's own top-level files)."""
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 and parts[0] == "florist" else None


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_module_over_400_lines_and_no_function_over_60(path):
    lines = path.read_text().splitlines()
    assert len(lines) <= 400, f"{_name(path)} has {len(lines)} lines"
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            assert length <= 60, f"{_name(path)}:{node.name} has {length} lines"


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_a_layer_imports_only_the_layers_below_it(path):
    module = _name(path).removesuffix(".py").replace("/", ".")
    own = _layer(module)
    if own is None:
        return
    imported = set()
    for node in ast.parse(path.read_text()).body:  # module level: an import inside a function is a late reference
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
    # A strategy's halves and their machinery sit above the registry and the run config, which read its spec.
    half = module.startswith("florist.strategies.") and module.count(".") == 3 and not module.endswith(".spec")
    ceiling = LAYERS["server"] if half else own
    above = sorted(m for m in imported if (layer := _layer(m)) is not None and layer > ceiling)
    assert not above, f"{module} imports {above}, a layer above it"


def test_test_files_have_unique_names():
    """The tests folders have no __init__.py, so pytest imports each test file by its bare name:
    two files of one name in two folders stop the whole collection."""
    names = [p.name for p in Path(__file__).parent.rglob("test_*.py") if "apps" not in p.parts]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
