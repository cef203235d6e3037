"""Every florist name and path the docs write exists, so that a rename or a move fails here, not
in a reader's editor.

What is checked, in README.md and docs/**/*.md, inside code blocks and `backticks` only:

- `florist.a.b.c` (and `florist.a.b:c`, an app path): a module, or an attribute of one;
- `from florist.a import b, c` in a code block: each imported name;
- `florist/...`, `tests/...`, `benchmarks/...`, `docker/...`: a file or folder of the checkout,
  a glob matching at least one, `{a,b}` braces expanded. A path with a `<placeholder>` is a
  pattern, not a name, and paths .gitignore lists are made by the commands around them: both
  are skipped, as is a path inside another one (`~/.cache/florist/nodes`);
- a ```python block right after a paragraph naming a `florist/....py` file is an excerpt of it:
  each class and function it writes is there (same bases, same parameter names), and each name
  it reads that it does not define is one of the file's globals (or a builtin).

Shell commands (`florist simulate`) are not names: only `florist.` and `florist/` count.
"""

from __future__ import annotations

import ast
import builtins
import fnmatch
import functools
import importlib
import importlib.util
import itertools
import re
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)  # never across a blank line
BEFORE = r"(?<![\w./~$-])"  # not the tail of a longer path or name
DOTTED = re.compile(BEFORE + r"florist(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?")
PATH = re.compile(BEFORE + r"(?:florist|tests|benchmarks|docker)/(?:[\w.*?<>/-]|\{[^{}\s]*\})*")
SOURCE = re.compile(r"`(florist/[\w/]+\.py)`")
IGNORED = [p.strip().rstrip("/") for p in (REPO / ".gitignore").read_text().splitlines() if p.strip()[:1] not in "#!"]


def _rel(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def _code(text: str) -> list[tuple[int, str, str]]:
    """(offset, language, text) of every code block ('' for an inline span) of a page."""
    pieces = [(m.start(2), m.group(1), m.group(2)) for m in FENCE.finditer(text)]
    prose = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # same offsets, no fences
    return pieces + [(m.start(2), "", m.group(2)) for m in SPAN.finditer(prose)]


def _imported_module(module: str) -> ModuleType | str:
    """The module, or why importing it fails (a name that exists but breaks is not "missing")."""
    try:
        return importlib.import_module(module)
    except Exception as error:
        return f"importing {module} fails ({type(error).__name__}: {error})"


@functools.cache
def _problem(name: str) -> str | None:
    """None when `florist.a.b` (or `florist.a:b`) is a module or an attribute of one; else what is wrong."""
    parts = name.replace(":", ".").split(".")
    obj: object = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        module = ".".join(parts[:i])
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif hasattr(obj, "__path__") and importlib.util.find_spec(module) is not None:  # a package's module
            obj = _imported_module(module)
            if isinstance(obj, str):
                return f"`{name}`: {obj}"
        else:
            return f"`{name}` does not exist"
    return None


def _expanded(path: str) -> list[str]:
    """`a/{b,c}.py` as `a/b.py` and `a/c.py`."""
    brace = re.search(r"\{([^{}]*)\}", path)
    if not brace:
        return [path]
    return [
        x for alt in brace.group(1).split(",") for x in _expanded(path[: brace.start()] + alt + path[brace.end() :])
    ]


def _ignored(path: str) -> bool:
    """Whether .gitignore lists `path` or a folder above it (its simple patterns: names, or
    paths from the root)."""
    for pattern in IGNORED:
        if "/" in pattern:
            if path == pattern or path.startswith(pattern + "/"):
                return True
        elif any(fnmatch.fnmatch(part, pattern) for part in path.split("/")):
            return True
    return False


def _path_exists(path: str) -> bool:
    if any(c in path for c in "*?"):
        return any(REPO.glob(path.rstrip("/")))
    return (REPO / path).exists()


def _paths(text: str) -> list[tuple[int, str]]:
    """(offset, path) of each checkable path in `text`."""
    found = []
    for m in PATH.finditer(text):
        path = m.group(0).rstrip(".")
        if "<" not in path and not _ignored(path):
            found.append((m.start(), path))
    return found


def _names(text: str) -> list[tuple[int, str]]:
    """(offset, name) of each `florist.` name in `text`."""
    return [(m.start(), m.group(0)) for m in DOTTED.finditer(text)]


def _imported(tree: ast.Module) -> list[tuple[int, str]]:
    """(line in the block, name) of each name a Python block imports from florist."""
    return [
        (node.lineno, f"{node.module}.{alias.name}")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "florist"
        for alias in node.names
    ]


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _defs(tree: ast.Module) -> dict[tuple[str, str], ast.AST]:
    """The classes and functions of a module, with the methods of its classes, by (class, name)."""
    found: dict[tuple[str, str], ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            found[("", node.name)] = node
        if isinstance(node, ast.ClassDef):
            found |= {(node.name, f.name): f for f in node.body if isinstance(f, ast.FunctionDef)}
    return found


def _header(node: ast.AST) -> str:
    """`class X(A, B)` or `def f(a, b)`: what an excerpt must keep of a definition."""
    if isinstance(node, ast.ClassDef):
        return f"class {node.name}({', '.join(ast.unparse(b) for b in node.bases)})"
    a = node.args
    names = [x.arg for x in [*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs]]
    return f"def {node.name}({', '.join(names + ([f'**{a.kwarg.arg}'] if a.kwarg else []))})"


def _unbound(tree: ast.Module) -> dict[str, int]:
    """The names a block reads but never binds, with the line of the first read."""
    bound = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
    reads = sorted((n.lineno, n.id) for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))
    unbound: dict[str, int] = {}
    for lineno, name in reads:
        if name not in bound and not hasattr(builtins, name):
            unbound.setdefault(name, lineno)
    return unbound


def _excerpt_of(text: str, start: int) -> str | None:
    """The `florist/....py` file that the paragraph right before the block at `start` names first."""
    before = text[:start].rsplit("```", 1)[0].rstrip()
    found = SOURCE.search(re.split(r"\n[ \t]*\n", before)[-1])
    return found.group(1) if found else None


def _excerpt_problems(snippet: ast.Module, source: str) -> list[tuple[int, str]]:
    """(line in the block, problem) of each definition or name that `source` does not have."""
    real = _defs(ast.parse((REPO / source).read_text()))
    problems = []
    for key, node in _defs(snippet).items():
        if key not in real:
            problems.append((node.lineno, f"`{_header(node)}` is not in {source}"))
        elif _header(node) != _header(real[key]):
            problems.append((node.lineno, f"`{_header(node)}`, but {source} has `{_header(real[key])}`"))
    module = _imported_module(source.removesuffix(".py").replace("/", "."))
    if isinstance(module, str):
        return problems + [(1, module)]
    for name, lineno in _unbound(snippet).items():
        if not hasattr(module, name):
            problems.append((lineno, f"`{name}` is not a name of {source}"))
    return problems


def _python_problems(text: str, start: int, code: str) -> list[tuple[int, str]]:
    """(offset in the page, problem) for a Python block: its florist imports, and, when it is an
    excerpt of a file, whether the file still says so."""
    try:
        tree = ast.parse(code)
    except SyntaxError as error:
        return [(start, f"the Python block does not parse ({error.msg}, its line {error.lineno})")]
    lines = [start, *itertools.accumulate((len(line) for line in code.splitlines(True)), initial=start)]
    problems = [(lines[n], _problem(name)) for n, name in _imported(tree) if _problem(name)]
    source = _excerpt_of(text, start)
    if source and (REPO / source).is_file():
        problems += [(lines[n], problem) for n, problem in _excerpt_problems(tree, source)]
    return problems


def _missing(page: str, text: str) -> list[str]:
    """`page:line: problem` for each name or path of `text` that the checkout does not have."""
    problems: list[tuple[int, str]] = []
    for start, lang, code in _code(text):
        problems += [(start + o, _problem(name)) for o, name in _names(code) if _problem(name)]
        for o, path in _paths(code):
            if not all(_path_exists(p) for p in _expanded(path)):
                problems.append((start + o, f"`{path}` is not in the checkout"))
        if lang == "python":
            problems += _python_problems(text, start, code)
    return [f"{page}:{_line(text, o)}: {problem}" for o, problem in sorted(problems)]


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_florist_name_and_path_in_the_docs_exists(page):
    problems = _missing(_rel(page), page.read_text())
    assert not problems, "\n".join(problems)


def test_the_check_finds_drift_and_skips_what_is_not_a_name():
    """The check can fail: each kind of drift is caught, and commands, placeholders, paths made
    by commands and paths inside other folders are not taken for names."""
    page = (
        "Run `florist simulate`; `florist.common.data.ClientData` and `florist.common.nope`.\n"
        "`florist/common/{data,nope}.py`, `tests/common/test_*.py`, `benchmarks/nope*.py`,\n"
        "`florist/strategies/<name>/spec.py`, `~/.cache/florist/nodes`, `docker/certs/ca.crt`.\n"
        "\n"
        "`florist/common/data.py` holds:\n"
        "\n"
        "```python\n"
        "from florist.common.data import ClientData, nope\n"
        "class ClientData(Base):\n"
        "    pass\n"
        "def split_indices(n, seed):\n"
        "    return split_indices(n, seed), DIGITS_CLASSES, len(seed)\n"
        "```\n"
    )
    assert _missing("page.md", page) == [
        "page.md:1: `florist.common.nope` does not exist",
        "page.md:2: `florist/common/{data,nope}.py` is not in the checkout",
        "page.md:2: `benchmarks/nope*.py` is not in the checkout",
        "page.md:8: `florist.common.data.nope` does not exist",
        "page.md:9: `Base` is not a name of florist/common/data.py",
        "page.md:9: `class ClientData(Base)`, but florist/common/data.py has `class ClientData()`",
        "page.md:11: `def split_indices(n, seed)`, but florist/common/data.py has "
        "`def split_indices(n, val_fraction, test_fraction, seed)`",
    ]
