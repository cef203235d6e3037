"""A private virtual network on one Linux machine, so that a local federation looks to its
processes as it would spread over several devices: every host (the SuperLink, each SuperNode)
in a network namespace of its own with one address and no loopback shared with the others,
linked by a veth pair to a bridge that lives in a namespace of its own (the switch).

Nothing of it appears in the machine's own namespace (its `ip link` and routes are
untouched), and everything is made and removed with iproute2's `ip`, which needs root.
Removing the network first stops whatever still runs in its namespaces: only this network's
users started processes there.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from florist.common.processes import terminate

SUPERLINK = "superlink"  # the host names a federation's network has
NETNS_DIR = Path("/run/netns")  # where `ip netns` keeps the namespaces it names
CANDIDATES = [ipaddress.ip_network(f"10.213.{k}.0/24") for k in range(256)]
LINK = "eth0"  # each host's one interface, in its own namespace
_CLONE_NEWNET = 0x40000000
_count = itertools.count()


def node(i: int) -> str:
    """The host name of SuperNode i."""
    return f"node-{i}"


class Network:
    """Hosts on one /24, each in its own namespace. Use as a context manager: everything it
    made, and every process still running inside, is removed on exit."""

    def __init__(self, hosts: list[str]):
        if not 0 < len(hosts) <= 253:
            raise ValueError(f"a network holds 1 to 253 hosts (one /24), not {len(hosts)}")
        if too_long := [h for h in hosts if len(h) > 15]:  # each names its port on the switch
            raise ValueError(f"host names are at most 15 characters (interface names): {too_long[0]!r}")
        self.hosts = list(hosts)
        self.prefix = _free_prefix()
        self.switch = f"{self.prefix}-switch"
        self.subnet: ipaddress.IPv4Network | None = None
        self.made: list[str] = []  # namespaces made so far, removed on exit

    @classmethod
    def for_federation(cls, num_nodes: int) -> Network:
        return cls([SUPERLINK, *(node(i) for i in range(num_nodes))])

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        assert self.subnet is not None, "the network is not made yet"
        return str(self.subnet[1 + self.hosts.index(host)])

    def command(self, host: str, args: list[str]) -> list[str]:
        """`args`, run inside `host`'s namespace."""
        return [_ip_binary(), "netns", "exec", self.namespace(host), *args]

    @contextlib.contextmanager
    def inside(self, host: str) -> Iterator[None]:
        """The calling thread in `host`'s namespace: sockets it opens meanwhile are that host's
        (they stay there afterwards)."""
        with open("/proc/thread-self/ns/net") as home, open(NETNS_DIR / self.namespace(host)) as there:
            try:
                _setns(there.fileno())
                yield
            finally:
                with _signals_held():  # a Ctrl-C here must not leave this thread in the namespace
                    _setns(home.fileno())

    def set_link(self, host: str, up: bool) -> None:
        """Plug `host`'s link into the switch, or pull it out: its end sees the carrier go, its
        connections stay open, and what they send meanwhile is lost."""
        _ip("-n", self.switch, "link", "set", "dev", host, "up" if up else "down")

    # --- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Network:
        try:
            with _signals_held():  # a Ctrl-C meanwhile lands below, once all that was made is known
                self.make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def make(self) -> None:
        check_usable()
        self.subnet = _unused_subnet()
        self._add_namespace(self.switch)
        _ip("-n", self.switch, "link", "add", "name", "switch", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "dev", "switch", "up")
        for host in self.hosts:
            namespace = self._add_namespace(self.namespace(host))
            # Both ends are made where they live: neither ever shows up in this machine's namespace.
            _ip(
                "-n", self.switch, "link", "add", "name", host, "type", "veth", "peer", "name", LINK, "netns", namespace
            )
            _ip("-n", self.switch, "link", "set", "dev", host, "master", "switch", "up")
            _ip("-n", namespace, "addr", "add", f"{self.address(host)}/{self.subnet.prefixlen}", "dev", LINK)
            _ip("-n", namespace, "link", "set", "dev", LINK, "up")
            _ip("-n", namespace, "link", "set", "dev", "lo", "up")

    def remove(self) -> None:
        """Stop what still runs in the namespaces, then delete them (their links go with them).
        A Ctrl-C waits until this is done, so that an impatient second one leaves nothing behind."""
        left = []
        with _signals_held():
            for namespace in reversed(self.made):
                terminate(_pids(namespace), grace=2.0)
                try:
                    _ip("netns", "del", namespace)
                except RuntimeError:
                    if (NETNS_DIR / namespace).exists():
                        left.append(namespace)
            self.made = [n for n in self.made if n in left]
        if left:
            raise RuntimeError(f"could not remove network namespace(s) {', '.join(left)}: try `ip netns del NAME`")

    def _add_namespace(self, name: str) -> str:
        _ip("netns", "add", name)  # (never one that exists: `_free_prefix`; and signals are held, so it is recorded)
        self.made.append(name)
        return name

    def describe(self) -> str:
        """Where each host is, and how to look at it while it runs."""
        lines = [f"Network {self.subnet}: namespaces {self.prefix}-*, a bridge in {self.switch}"]
        lines += [f"  {host}: {self.address(host)} in {self.namespace(host)}" for host in self.hosts]
        example = self.namespace(SUPERLINK)
        lines.append(f"  inspect: ip netns list; ip -n {self.switch} link; ip netns exec {example} ss -tnp")
        return "\n".join(lines)


def check_usable() -> None:
    """Refuse at once, in one line, where namespaces cannot be made."""
    if sys.platform != "linux":
        raise RuntimeError("--netns needs Linux (network namespaces)")
    if os.geteuid() != 0:
        raise RuntimeError(
            "--netns needs root: network namespaces and links are made with `ip netns` (run as root, "
            "or leave --netns out)"
        )
    _ip_binary()


def probe() -> str | None:
    """None where a network can be made here (tried: two hosts, made and removed), else why not."""
    try:
        with Network(["a", "b"]):
            return None
    except (RuntimeError, OSError) as err:
        return str(err)


def _ip_binary() -> str:
    found = shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.access(p, os.X_OK)), None)
    if not found:
        raise RuntimeError("--netns needs iproute2's `ip` command (e.g. apt-get install iproute2)")
    return found


def _ip(*args: str) -> str:
    """`ip ARGS`, out of the terminal's process group: a Ctrl-C there does not cut it short."""
    done = subprocess.run([_ip_binary(), *args], capture_output=True, text=True, timeout=30, start_new_session=True)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or f'status {done.returncode}'}")
    return done.stdout


def _pids(namespace: str) -> list[int]:
    try:
        found = _ip("netns", "pids", namespace).split()
    except RuntimeError:  # gone already
        return []
    return [int(pid) for pid in found if pid.isdigit() and int(pid) != os.getpid()]


def _free_prefix() -> str:
    """`fl<pid>-<n>`, with the first n no namespace here already starts with (a stale one
    from a process that died with the same pid)."""
    existing = {p.name for p in NETNS_DIR.iterdir()} if NETNS_DIR.is_dir() else set()
    while True:
        prefix = f"fl{os.getpid()}-{next(_count)}"
        if not any(name.startswith(f"{prefix}-") for name in existing):
            return prefix


def _unused_subnet() -> ipaddress.IPv4Network:
    """The first 10.213.k.0/24 that overlaps no address or route of this machine: an address
    in a log then names one host only."""
    used = [
        ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False)
        for link in json.loads(_ip("-j", "-4", "addr") or "[]")
        for a in link.get("addr_info", [])
    ]
    used += [
        ipaddress.ip_network(r["dst"])
        for r in json.loads(_ip("-j", "-4", "route") or "[]")
        if r.get("dst", "default") != "default"
    ]
    for subnet in CANDIDATES:
        if not any(subnet.overlaps(u) for u in used):
            return subnet
    raise RuntimeError("no free subnet in 10.213.0.0/16 for the federation's network")


def _setns(fd: int) -> None:
    if hasattr(os, "setns"):  # Python 3.12+
        os.setns(fd, _CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive within reach their handlers when the block ends, so that
    a handler that raises (florist's do) cannot leave it half done. Handlers are swapped, not
    the signal mask: any thread may take a signal, and Python runs the handler regardless."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread runs Python's signal handlers
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _: caught.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)
        for number in dict.fromkeys(caught):
            signal.raise_signal(number)
