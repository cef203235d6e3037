"""Every shell block of README.md and docs/**/*.md runs here, or says in the Markdown why not.

A block is a ```bash, ```sh, ```shell or ```console fence (in a console block, the lines after
`$ ` are the commands). The HTML comment on the last non-blank line before the fence decides:

    (no comment)                          the suite runs it, at the CI sizes of SIZES below
    <!-- docs-check only: REASON -->      only `make docs-check` runs it (as written: minutes)
    <!-- not run: REASON -->              nothing runs it; REASON says why it cannot run here
                                          (a second machine, root, a Docker engine, the hub, ...)

Any other comment there, or a marker without a reason, fails the test.

How a page's blocks run. Each page gets a fresh temporary folder holding a copy of the checkout
(every file but caches, results and the environment, modification times kept) with `.venv` a
link to the checkout's environment, so that commands written for the repository root work
(`. .venv/bin/activate`, `flwr run .`) and whatever they write stays in the copy. The blocks
run in page order, as a reader runs them, each twice in a row in the same folder: the second run
catches a snippet that works only once (a config section appended twice, a key registered
twice, a CA made twice). Each run is `bash` with `set -euo pipefail`, HOME (so `~/.cache`),
FLWR_HOME and XDG_CACHE_HOME=$HOME/.cache inside the temporary folder, the environment's bin
first on PATH, and free ports for Flower's local SuperLink (FLWR_LOCAL_*_PORT). Flower's
default ports in a block, 9092 (Fleet API) and 8000 (HTTP API), become free ports too, so a
block never meets another SuperLink on this machine. After each run, every process the block
started is stopped by PID (SIGTERM, then SIGKILL): those whose environment carries this run's
FLORIST_DOCS_RUN marker or whose working directory is in the temporary folder; a block may leave
a server running for its reader (the local SuperLink of `flwr run . local`), the test does not.
A run past its time limit fails.

Sizes. In the suite, SIZES rewrites the sizes of a block through the options it already has
(`--rounds 30` runs as `--rounds 1`), never adding or removing an option; each entry must apply
to some block the suite runs. `make docs-check` (FLORIST_DOCS_FULL=1) runs every runnable block
as written, the docs-check-only ones too.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from florist.deploy.spawning import free_port

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FULL = os.environ.get("FLORIST_DOCS_FULL") == "1"
SHELLS = ("bash", "sh", "shell", "console")
RUN_LIMIT_S = 4 * 3600 if FULL else 300  # one run of one block (docs-check: 24 runs of compare)
MARKER = re.compile(r"<!--\s*(not run|docs-check only)\s*:(.*?)-->\s*$", re.S)
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
COPY_SKIP = {".git", ".venv", ".hypothesis", ".pytest_cache", ".ruff_cache", "__pycache__"}
COPY_SKIP |= {"results", "out", "build", "certs", "florist-federation"}  # what .gitignore lists


def _cap(cap: int) -> Callable[[re.Match], str]:
    return lambda m: m.group(1) + str(min(int(m.group(2)), cap))


# The suite's sizes: (option, how its value is rewritten). Each keeps the option and lowers its
# value to the cap; a block's value below the cap stays.
SIZES: list[tuple[str, Callable[[re.Match], str]]] = [
    (r"(--rounds )(\d+)", _cap(1)),
    (r"(num-server-rounds=)(\d+)", _cap(1)),
    (r"(--num-clients )(\d+)", _cap(3)),
    (r"(--num-nodes )(\d+)", _cap(2)),
    (r"(min-nodes=)(\d+)", _cap(2)),
    (r"(--seeds )([\d,]+)", lambda m: m.group(1) + m.group(2).split(",")[0]),  # the first seed
]
PORTS = (9092, 8000)  # Flower's Fleet API and HTTP API ports: free ports instead, in both modes


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence
    kind: str  # "run", "docs-check only" or "not run"
    reason: str
    text: str

    @property
    def runs(self) -> bool:
        return self.kind == "run" or (FULL and self.kind == "docs-check only")

    def first_line(self) -> str:
        return next((line.strip() for line in self.text.splitlines() if line.strip()), "")


def blocks(markdown: str, page: str) -> list[Block]:
    """The shell blocks of a page with what their markers say; ValueError naming the page and
    line for a comment before a block that is not a marker with a reason."""
    found = []
    for fence in FENCE.finditer(markdown):
        if fence.group(1) not in SHELLS:
            continue
        line = markdown.count("\n", 0, fence.start()) + 1
        before = markdown[: fence.start()].rstrip().rsplit("\n", 1)[-1]
        kind, reason = "run", ""
        if before.lstrip().startswith("<!--"):
            comment = before[before.index("<!--") :]
            marker = MARKER.match(comment.strip())
            if not marker:
                raise ValueError(
                    f"{page}:{line}: the comment before this block is neither "
                    "'<!-- not run: REASON -->' nor '<!-- docs-check only: REASON -->'"
                )
            kind, reason = marker.group(1), marker.group(2).strip()
            if not reason:
                raise ValueError(f"{page}:{line}: '{kind}' without a reason: say why it cannot run here")
        text = fence.group(2)
        found.append(Block(page, line, kind, reason, _commands(text) if fence.group(1) == "console" else text))
    return found


def _commands(console: str) -> str:
    """A console block's commands: each `$ ` line and the lines it continues with a backslash."""
    commands, going_on = [], False
    for line in console.splitlines():
        if line.startswith("$ ") or going_on:
            commands.append(line[2:] if line.startswith("$ ") and not going_on else line)
            going_on = line.endswith("\\")
    return "\n".join(commands) + "\n"


def resized(text: str) -> str:
    if FULL:
        return text
    for pattern, rewrite in SIZES:
        text = re.sub(pattern, rewrite, text)
    return text


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page.read_text(), page.relative_to(REPO).as_posix())]


def test_a_comment_before_a_block_must_be_a_marker_with_a_reason():
    page = "text\n\n{}\n```bash\necho hi\n```\n"
    assert [b.kind for b in blocks(page.format(""), "p.md")] == ["run"]
    [marked] = blocks(page.format("<!-- not run: needs a second machine -->"), "p.md")
    assert (marked.kind, marked.reason, marked.runs) == ("not run", "needs a second machine", False)
    assert blocks(page.format("<!-- docs-check only: takes minutes -->"), "p.md")[0].runs is FULL
    with pytest.raises(ValueError, match=r"^p\.md:4: 'not run' without a reason"):
        blocks(page.format("<!-- not run: -->"), "p.md")
    with pytest.raises(ValueError, match=r"^p\.md:4: the comment before this block is neither"):
        blocks(page.format("<!-- skip -->"), "p.md")


def test_console_blocks_run_their_commands_and_other_fences_are_not_shell():
    page = "```console\n$ florist --version \\\n    --debug\nflorist 0.1.0\n$ ls\n```\n```python\nx = 1\n```\n"
    [block] = blocks(page, "p.md")
    assert block.text == "florist --version \\\n    --debug\nls\n"


def test_sizes_lower_the_options_a_block_has_and_add_none():
    block = 'florist compare --seeds 1,2,3 --rounds 30 --num-clients 3 --run-config "min-nodes=1 num-server-rounds=5"'
    expected = 'florist compare --seeds 1 --rounds 1 --num-clients 3 --run-config "min-nodes=1 num-server-rounds=1"'
    assert resized(block) == (block if FULL else expected)


def test_every_block_runs_or_says_why_it_cannot():
    """Collecting every page fails on a bad marker; and every size rewrite is in use."""
    found = all_blocks()
    assert found, "no shell blocks in README.md and docs/"
    if not FULL:
        suite = "\n".join(b.text for b in found if b.runs)
        unused = [pattern for pattern, _ in SIZES if not re.search(pattern, suite)]
        assert not unused, f"SIZES entries that no block the suite runs has: {unused}"


@pytest.mark.parametrize("before", ["no file", "an empty file", "another connection only"])
def test_the_local_connection_snippet_works_whatever_config_there_is(before, tmp_path):
    """Issue 33, point 1: Flower writes its default config (with `local`) only where there is no
    file, so `flwr run . local` failed after a snippet had created the file. The snippet that
    docs/running.md gives must leave `local` in any config, once, however often it runs."""
    [snippet] = [
        b for b in blocks((REPO / "docs/running.md").read_text(), "running.md") if "[superlink.local]" in b.text
    ]
    env = _private_env(tmp_path)
    config = Path(env["FLWR_HOME"]) / "config.toml"
    if before != "no file":
        config.parent.mkdir(parents=True)
        config.write_text(
            '[superlink.box]\naddress = "127.0.0.1:8000"\ninsecure = true\n' if "another" in before else ""
        )
    for _ in range(2):
        subprocess.run(["bash", "-c", "set -euo pipefail\n" + snippet.text], env=env, cwd=tmp_path, check=True)
    assert tomllib.loads(config.read_text())["superlink"]["local"] == {"address": ":local:"}
    listed = subprocess.run(["flwr", "config", "list"], env=env, capture_output=True, text=True, check=True).stdout
    assert re.search(r"^\s+local\b", listed, re.M), listed
    assert config.read_text().count("[superlink.local]") == 1


def _runs_any(page: Path) -> bool:
    try:
        return any(b.runs for b in blocks(page.read_text(), page.relative_to(REPO).as_posix()))
    except ValueError:
        return True  # its run reports the bad marker, as the test above does


RUNNABLE = [page for page in PAGES if _runs_any(page)]


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_shell_blocks_of_a_page_run_twice_in_a_row(page, tmp_path):
    work = _checkout_copy(tmp_path / "checkout")
    env = _private_env(tmp_path)
    ports = {old: free_port() for old in PORTS}
    for block in blocks(page.read_text(), page.relative_to(REPO).as_posix()):
        if not block.runs:
            continue
        script = resized(block.text)
        for old, new in ports.items():
            script = re.sub(rf"\b{old}\b", str(new), script)
        for attempt in (1, 2):
            _run(block, script, attempt, work, env | {"FLORIST_DOCS_RUN": f"{os.getpid()}-{time.monotonic_ns()}"})


def _checkout_copy(dest: Path) -> Path:
    def skip(folder: str, names: list[str]) -> set[str]:
        return {n for n in names if n in COPY_SKIP or n.endswith(".egg-info")}

    shutil.copytree(REPO, dest, ignore=skip, symlinks=True)
    (dest / ".venv").symlink_to(Path(sys.prefix))
    return dest


def _private_env(tmp: Path) -> dict[str, str]:
    home = tmp / "home"
    home.mkdir()
    env = dict(os.environ)
    for name in ("FLWR_HOME", "XDG_CACHE_HOME", "VIRTUAL_ENV", "PYTHONPATH"):
        env.pop(name, None)
    return env | {
        "HOME": str(home),
        "FLWR_HOME": str(home / ".flwr"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "PATH": f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
    }


def _run(block: Block, script: str, attempt: int, work: Path, env: dict[str, str]) -> None:
    """One run of `block` in `work`; stops whatever it left running, then checks its exit."""
    log = work.parent / f"block-{block.line}-run{attempt}.log"
    started = time.monotonic()
    with open(log, "wb") as out:  # a file, not a pipe: a process left running could hold a pipe open
        shell = subprocess.Popen(
            ["bash", "-c", "set -euo pipefail\n" + script],
            cwd=work,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = shell.wait(timeout=RUN_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
            code = None
    left = _stop_started(env["FLORIST_DOCS_RUN"], work.parent)
    where = f"{block.page}:{block.line} ({block.first_line()!r}), run {attempt} of 2"
    output = log.read_text(errors="replace")[-4000:]
    assert code is not None, f"{where} ran past {RUN_LIMIT_S} s:\n{output}"
    seconds = time.monotonic() - started
    print(f"{where}: exit {code}, {seconds:.1f} s")  # pytest -s shows each run's time
    assert code == 0, f"{where} exited {code} after {seconds:.0f} s:\n{script}\n---\n{output}"
    assert not left, f"{where}: processes still running after SIGKILL: {left}"


def _stop_started(marker: str, tmp: Path) -> list[int]:
    """Stop every process carrying `marker` in its environment or working in `tmp`, by PID:
    SIGTERM, up to 15 s, then SIGKILL. Returns those that outlived SIGKILL by 5 s."""
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        pids = _started(marker, tmp)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = _started(marker, tmp)
        if not pids:
            return []
    return pids


def _started(marker: str, tmp: Path) -> list[int]:
    token, root = f"FLORIST_DOCS_RUN={marker}".encode(), str(tmp)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                if stat.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                    continue  # a zombie: gone, waiting for its parent to read its status
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if token in environ or cwd == root or cwd.startswith(root + os.sep):
            found.append(int(entry))
    return found
