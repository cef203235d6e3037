"""docs/deployment.md's exposure table stays true: every socket a secured local federation listens
on (its SuperLink, its SuperNodes, their executors and the fork server) is a row of the table,
bound where the row says; a listener the table does not name fails this test. Who can reach each
is tested where it is enforced (test_superlink_guard.py: 403 to another uid; test_join_exposure.py:
401 without the SuperExec secret, the fork server's peer check)."""

import ipaddress
import os
import re
import stat
from pathlib import Path

import pytest
from processes import node_configs

from florist.deploy.federation import LocalFederation

DOC = Path(__file__).parents[2] / "docs" / "deployment.md"
FLEET, CONTROL, NODE, FORK = (
    "SuperLink Fleet API (gRPC)",
    "SuperLink Control and Runtime API (HTTP)",
    "SuperNode Runtime API (HTTP)",
    "Fork server (Unix socket)",
)


def table() -> dict[str, dict[str, str]]:
    """The exposure table's rows, by their first cell."""
    text = DOC.read_text()
    section = text[text.index("## What is exposed where") :].split("\n## ")[0]
    start = section.index("\n|") + 1
    lines = section[start:].split("\n\n")[0].splitlines()  # the first table of the section
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    return {row[0]: dict(zip(header, row, strict=True)) for row in rows}


def process_tree(roots: list[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(path.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(path.parent.name))
    seen, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo += children.get(pid, [])
    return seen


def listeners(pids: set[int]) -> list[tuple[str, str]]:
    """(kind, address) of every listening socket these processes hold: ("tcp", "HOST:PORT") with
    the host as /proc spells it, decoded; ("unix", path)."""
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    found = []
    for table_path in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table_path).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                host, port = fields[1].split(":")
                found.append(("tcp", f"{_host(host)}:{int(port, 16)}"))
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[6] in inodes and fields[5] == "01" and len(fields) > 7:  # a bound, listening socket
            found.append(("unix", fields[7]))
    return found


def _host(hexed: str) -> str:
    raw = bytes.fromhex(hexed)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    return str(getattr(address, "ipv4_mapped", None) or address)


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    root = tmp_path_factory.mktemp("exposure")
    with LocalFederation(root, node_configs(2, root), tls=True, auth=True) as fed:
        yield fed


def test_every_listener_of_a_secured_federation_is_a_row_of_the_table_bound_where_it_says(federation):
    rows = table()
    assert {FLEET, CONTROL, NODE, FORK} <= set(rows), sorted(rows)
    fed = federation
    roots = [p.pid for p in (fed.superlink, *fed.nodes, fed.fork_server) if p]
    found = listeners(process_tree(roots))
    named = {
        f"127.0.0.1:{fed.fleet_port}": FLEET,
        f"127.0.0.1:{fed.control_port}": CONTROL,
        **{f"127.0.0.1:{port}": NODE for port in fed.node_ports},
    }
    kinds = []
    for kind, address in found:
        if kind == "unix":
            folder = Path(re.sub(r"\.new$", "", address)).parent  # bound under a staged name, then renamed
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700, address
            kinds.append(FORK)
        else:
            assert address in named, f"a listener the exposure table does not name: {address}"
            kinds.append(named[address])
    assert sorted(kinds) == sorted([FLEET, CONTROL, *[NODE] * len(fed.nodes), FORK])
    for name in (FLEET, CONTROL, NODE):  # what a local federation binds, as the table says
        assert "127.0.0.1" in rows[name]["Where"], rows[name]
    assert "0700" in rows[FORK]["Where"]
    assert "403" in rows[CONTROL]["Who can reach it"] and "401" in rows[NODE]["Who can reach it"]
