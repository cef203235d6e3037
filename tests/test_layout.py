"""The house stays easy to walk: no module over 400 lines, no function over 60, and each folder
imports only the folders below it, counting imports inside functions too:

    common < config < client, server < strategies < apps < runners, deploy < cli

`apps` (the registry and the two Flower apps) is the only code that knows every strategy; a
strategy uses another only through FedAvg, the base the FedAvg-shaped ones build on."""

import ast
from pathlib import Path

import pytest

import florist

PACKAGE = Path(florist.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))
LAYERS = {
    "common": 0,
    "config": 1,
    "client": 2,
    "server": 2,
    "strategies": 3,
    "apps": 4,
    "runners": 5,
    "deploy": 5,
    "cli": 6,
}
SHARED_STRATEGY = "florist.strategies.fedavg"  # what another strategy's halves may build on


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def _module(path: Path) -> str:
    return _name(path).removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _folder(module: str) -> str | None:
    """The layer folder of `florist.X...` (`config` is a file of its own; None for the rest)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "florist" and parts[1] in LAYERS else None


def imports(path: Path) -> set[str]:
    """Every florist module `path` imports, at module level or inside a function (those run too:
    a deferred import is still a dependency), but not under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m.split(".")[0] == "florist"}


def folder_graph() -> dict[tuple[str, str], list[str]]:
    """(importing folder, imported folder) -> the imports that make the edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in MODULES:
        source = _folder(_module(path))
        for module in imports(path):
            target = _folder(module)
            if source and target and target != source:
                edges.setdefault((source, target), []).append(f"{_name(path)} imports {module}")
    return edges


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_module_over_400_lines_and_no_function_over_60(path):
    lines = path.read_text().splitlines()
    assert len(lines) <= 400, f"{_name(path)} has {len(lines)} lines"
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            assert length <= 60, f"{_name(path)}:{node.name} has {length} lines"


def test_no_folder_imports_a_folder_above_it_even_inside_a_function():
    edges = folder_graph().items()
    upward = [why for (source, target), whys in edges if LAYERS[target] > LAYERS[source] for why in whys]
    assert upward == []


def test_no_import_cycle_spans_two_folders():
    """Same-layer folders (client and server, runners and deploy) may use each other one way only."""
    edges = folder_graph()
    both_ways = [(a, b, edges[(a, b)][0], edges[(b, a)][0]) for a, b in edges if (b, a) in edges and a < b]
    assert both_ways == []


@pytest.mark.parametrize("path", sorted((PACKAGE / "strategies").rglob("*.py")), ids=_name)
def test_a_strategy_uses_another_only_through_fedavg(path):
    own = ".".join(_module(path).split(".")[:3])
    mine = (own, own + ".", SHARED_STRATEGY)
    others = sorted(m for m in imports(path) if m.startswith("florist.strategies.") and not m.startswith(mine))
    assert others == [], f"{_name(path)} reaches into {others}"


def test_only_apps_and_above_name_the_registry():
    below = [
        f"{_name(path)} imports {module}"
        for path in MODULES
        if (folder := _folder(_module(path))) and LAYERS[folder] < LAYERS["apps"]
        for module in imports(path)
        if module.startswith("florist.apps")
    ]
    assert below == []


def test_test_files_have_unique_names():
    """The tests folders have no __init__.py, so pytest imports each test file by its bare name:
    two files of one name in two folders stop the whole collection."""
    names = [p.name for p in Path(__file__).parent.rglob("test_*.py") if "apps" not in p.parts]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
