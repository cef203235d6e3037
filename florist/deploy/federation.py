"""A real federation on one machine: one SuperLink and N SuperNodes as separate OS processes on
127.0.0.1 (or, given a `netns.Network`, each in a network namespace of its own with its own
address), talking over Flower's gRPC Fleet API, started and stopped by PID.

Only the Fleet port is meant to face a network; the Control/Runtime HTTP port (run submission,
no authentication in Flower 1.39) and each SuperNode's Runtime port always bind to 127.0.0.1,
the loopback of the process's own namespace. The SuperLink is `florist superlink`: its HTTP
port answers this user's connections only, and its Fleet API refuses oversized messages.
Where the SuperLink and the SuperNodes leave their tasks to executors (`--isolation process`:
warm executors, or Flower's SuperExec should the fork server fail), their Runtime APIs serve
tasks only to requests signed with one SuperExec auth secret per federation
(`--superexec-auth-secret-file`), kept in a private folder of its own.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from florist.common import devices, flower_internals
from florist.common.processes import terminate_marked
from florist.deploy import forkserver, netns
from florist.deploy.bundle import app_dir
from florist.deploy.certs import covers, make_ca_and_server, make_node_key
from florist.deploy.serving import ServerAppRunners
from florist.deploy.spawning import (
    LOCAL_NODE_CONFIG,
    Process,
    flower_bin,
    flower_env,
    free_port,
    spawn,
    superlink_command,
    supernode_command,
    toml_node_config,
)
from florist.deploy.superlink import message_limit

log = logging.getLogger(__name__)

CONNECTION = "florist-local"  # the name `flwr run . florist-local` uses


class LocalFederation(ServerAppRunners):
    """SuperLink + SuperNodes on loopback, or on `network` (`netns.Network.for_federation`, made
    and removed by the caller). Use as a context manager: everything it started is stopped on
    exit (SuperNodes first), by PID."""

    def __init__(
        self,
        workdir: str | Path,
        node_configs: list[dict[str, Any]],
        *,
        tls: bool = False,
        auth: bool = False,
        max_wait_time: float = 120.0,
        executor: str = "warm",
        persistent: bool = False,
        preload: str | None = None,
        network: netns.Network | None = None,
        trust_apps: Sequence[str] = (),
        max_message_bytes: int | None = None,
    ):
        """`trust_apps`: the sha256 of every app bundle its SuperNodes run (`florist supernode
        --trust-app`); none given, they run any (the SuperLink is this machine's own).
        `max_message_bytes`: the largest gRPC message its SuperLink accepts (`florist superlink
        --max-message-mb`; default: sized for any model, `superlink.message_limit`)."""
        if auth and not tls:
            raise ValueError("SuperNode authentication needs TLS: pass --tls with --auth")
        self.workdir = Path(workdir).expanduser().resolve()
        # The nodes share this machine: each gets an equal share of its cores for torch, unless its config says.
        share = {"torch-threads": max(1, devices.usable_cores() // max(len(node_configs), 1))}
        self.node_configs = [share | LOCAL_NODE_CONFIG | config for config in node_configs]
        self.tls, self.auth, self.max_wait_time = tls, auth, max_wait_time
        if executor == "warm" and not flower_internals.fast_path():  # which has said why, once
            executor = "flower"  # no fork server, no warm executors: Flower's SuperExec, SuperNodes and SuperLink
        self.executor, self.persistent, self.preload, self.network = executor, persistent, preload, network
        self.trust_apps = tuple(trust_apps)
        self.max_message_bytes = max_message_bytes or message_limit()
        self.host = network.address(netns.SUPERLINK) if network else "127.0.0.1"  # where SuperNodes dial
        self.flwr_home = self.workdir / "flwr-home"
        self.certs, self.keys, self.logs = self.workdir / "certs", self.workdir / "keys", self.workdir / "logs"
        self.database = self.workdir / "superlink.db"  # with `persistent`; else the SuperLink keeps its state in memory
        self.fleet_port, self.control_port = free_port(), free_port()
        self.node_ports = [free_port() for _ in node_configs]
        self.superlink: Process | None = None
        self.nodes: list[Process | None] = [None] * len(node_configs)
        self.fork_server: Process | None = None  # preloads once for every warm executor here
        self.fork_socket: Path | None = None
        self.private: Path | None = None  # 0700, outside the workdir: the fork server's socket, the auth secret
        self.auth_secret: Path | None = None  # the SuperExec auth secret of every runtime with executors
        self.server_executor: forkserver.Forked | None = None  # runs the SuperLink's ServerApps, warm
        self.superexec: Process | None = None  # Flower's, for them, should the fork server fail us
        self.env = flower_env(self.flwr_home)

    @property
    def fleet_address(self) -> str:
        return f"{self.host}:{self.fleet_port}"

    @property
    def control_address(self) -> str:
        """On the SuperLink's loopback: reached from its namespace only (`_at_superlink`)."""
        return f"127.0.0.1:{self.control_port}"

    def _in(self, host: str, args: list[str]) -> list[str]:
        return self.network.command(host, args) if self.network else args

    def _at_superlink(self) -> AbstractContextManager:
        """Sockets opened within are opened where the SuperLink runs."""
        return self.network.inside(netns.SUPERLINK) if self.network else nullcontext()

    # --- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> LocalFederation:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 180.0, num_started: int | None = None) -> None:
        """Start the SuperLink, register node keys (with --auth), start and await the first
        `num_started` SuperNodes (all by default; the others can join later with `start_node`)."""
        for folder in (self.flwr_home, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        if self.tls and not covers(self.certs / "server.pem", [self.host]):
            # its CA's key is not kept: nothing under a run's folder can sign another certificate
            make_ca_and_server(self.certs, ["localhost", self.host])
        self._write_connection()
        if self.executor == "warm" and self.auth_secret is None:
            self.auth_secret = self._make_auth_secret()
        if self.executor == "warm" and self.network is None:  # in namespaces, executors must be in the node's
            self.start_fork_server()
        self.start_superlink()
        if self.auth:
            for i in range(len(self.node_configs)):
                self.register(self.node_key(i)[1])
        count = len(self.node_configs) if num_started is None else num_started
        for i in range(count):
            self.start_node(i)
        self.wait_for_nodes(count, timeout)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM to the SuperLink and every SuperNode at once, SIGKILL to any still running
        after `grace` seconds; then whatever else carries this federation's FLWR_HOME (their
        executors and ClientApps) gets the same."""
        if self.server_executor is not None:
            self.server_executor.terminate()  # lets go of its lifeline: it stops its ServerApps and exits
        running = [p for p in (*self.nodes, self.superlink, self.superexec, self.fork_server) if p and p.alive()]
        for process in running:
            process.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in running:
            try:
                process.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait()
        self._stop_server_executor(max(0.0, deadline - time.monotonic()))
        terminate_marked("FLWR_HOME", str(self.flwr_home), grace=2.0)
        if self.private:
            shutil.rmtree(self.private, ignore_errors=True)

    def _spawn(self, name: str, host: str, args: list[str]) -> Process:
        return spawn(self._in(host, args), self.logs / f"{name}.log", env=self.env, cwd=self.workdir)

    def start_superlink(self, timeout: float = 60.0) -> Process:
        """(Re)start the SuperLink on the same ports (and, if `persistent`, the same database, so
        node identities survive). In memory, its exchanges cost 2-3 times less than with SQLite.
        With a fork server, its ServerApps run warm (`--isolation process`, `_serve_runs`)."""
        self._stop_server_executor()  # an earlier SuperLink's: it must not take this one's runs
        if self.superexec is not None:
            self.superexec.stop(grace=5.0)
            self.superexec = None
        security = (
            [
                "--ssl-ca-certfile",
                str(self.certs / "ca.crt"),
                "--ssl-certfile",
                str(self.certs / "server.pem"),
                "--ssl-keyfile",
                str(self.certs / "server.key"),
            ]
            if self.tls
            else ["--insecure"]
        )
        args = [
            *superlink_command(self.max_message_bytes),
            *security,
            *(["--enable-supernode-auth"] if self.auth else []),
            "--fleet-api-address",
            self.fleet_address,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.control_port),
            "--disable-runtime-dependency-installation",
            *(["--database", str(self.database)] if self.persistent else []),
            *(["--isolation", "process", *self._signed()] if self.fork_socket else []),
        ]
        self.superlink = self._spawn("superlink", netns.SUPERLINK, args)
        self._wait_for_port("127.0.0.1", self.control_port, self.superlink, timeout)
        self._wait_for_port(self.host, self.fleet_port, self.superlink, timeout)
        if self.fork_socket:
            self._serve_runs(timeout)
        return self.superlink

    def node_key(self, i: int) -> tuple[Path, Path]:
        """The key pair of node i, made on first use (kept across restarts)."""
        private = self.keys / f"node-{i}"
        return (private, private.with_suffix(".pub")) if private.exists() else make_node_key(self.keys, f"node-{i}")

    def register(self, public_key: Path) -> None:
        """`flwr supernode register KEY.pub` (once per database when `persistent`; a SuperLink that
        keeps its state in memory starts with no registered key)."""
        marker = public_key.with_suffix(".registered")
        if self.persistent and marker.exists():
            return
        result = self.flwr("supernode", "register", str(public_key), CONNECTION, "--name", public_key.stem)
        if result.returncode != 0:
            raise RuntimeError(f"registering {public_key} failed:\n{result.stdout}{result.stderr}")
        marker.write_text(result.stdout)

    def start_node(self, i: int, *, private_key: Path | None = None, root_certificates: Path | None = None) -> Process:
        """Start SuperNode i (bounded reconnection, so it never retries forever)."""
        args = [
            *supernode_command(self.executor, self.preload, self.fork_socket),
            "--superlink",
            self.fleet_address,
            "--port",
            str(self.node_ports[i]),
            "--node-config",
            toml_node_config(self.node_configs[i]),
            "--max-wait-time",
            str(self.max_wait_time),
            *(self._signed() if self.executor == "warm" else []),  # `--isolation process`, a warm executor
            *(f"--trust-app={sha256}" for sha256 in self.trust_apps),
        ]
        if self.tls:
            args += ["--root-certificates", str(root_certificates or self.certs / "ca.crt")]
            if self.auth:
                args += ["--auth-supernode-private-key", str(private_key or self.node_key(i)[0])]
        else:
            args.append("--insecure")
        self.nodes[i] = self._spawn(f"supernode-{i}", netns.node(i), args)
        return self.nodes[i]

    # --- queries ---------------------------------------------------------------------------
    def flwr(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """Run the `flwr` CLI against this federation's private FLWR_HOME."""
        return subprocess.run(
            self._in(netns.SUPERLINK, [flower_bin("flwr"), *args]),
            env=self.env,
            cwd=self.workdir,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def online_nodes(self) -> list[int]:
        """IDs of the SuperNodes the SuperLink lists as online (empty while it cannot answer):
        asked through the Control API's client, or off the fast path with `flwr supernode list`."""
        import httpx

        if not flower_internals.fast_path():
            return self._online_nodes_cli()
        try:
            with self._at_superlink():
                return flower_internals.online_node_ids(
                    self.control_address, str(self.certs / "ca.crt") if self.tls else None
                )
        except httpx.HTTPError:  # not up yet, or restarting: the callers' loops are bounded
            return []

    def _online_nodes_cli(self) -> list[int]:
        """`flwr supernode list --format json`'s online nodes (2-3 CPU-seconds a call)."""
        try:
            listed = json.loads(self.flwr("supernode", "list", CONNECTION, "--format", "json", timeout=60).stdout)
            return sorted(int(n["node-id"]) for n in listed["nodes"] if n["status"] == "online")
        except (subprocess.TimeoutExpired, ValueError, KeyError, TypeError):  # not up yet, or restarting
            return []

    def wait_for_nodes(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.online_nodes()) < count:
            dead = [n for n in self.nodes if n and not n.alive()]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited (status {dead[0].popen.returncode}):\n{dead[0].tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"fewer than {count} SuperNodes connected within {timeout:.0f} s; logs in {self.logs}"
                )
            time.sleep(0.5)
        self.ensure_runs_served()

    def _wait_for_port(self, host: str, port: int, process: Process, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with self._at_superlink(), socket.socket() as sock:
                if sock.connect_ex((host, port)) == 0:
                    return
            if not process.alive():
                raise RuntimeError(f"{process.name} exited (status {process.popen.returncode}):\n{process.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{process.name} did not open port {port} within {timeout:.0f} s")
            time.sleep(0.2)

    def _write_connection(self) -> None:
        """The `flwr` CLI connection `florist-local` in this federation's FLWR_HOME."""
        security = f'root-certificates = "{self.certs / "ca.crt"}"' if self.tls else "insecure = true"
        (self.flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{self.control_address}"\n{security}\n'
        )

    def run_command(self, run_config: Mapping[str, Any], app: Path | None = None) -> list[str]:
        """`flwr run` of the florist app (or of the app in `app`) on this federation, streaming its log."""
        return self._in(
            netns.SUPERLINK,
            [
                flower_bin("flwr"),
                "run",
                str(app or app_dir()),
                CONNECTION,
                "--stream",
                "--run-config",
                toml_node_config(dict(run_config)),
            ],
        )

    def describe(self, submit: bool = True) -> str:
        """What a user needs to know: addresses, and (`submit`) how to submit a run."""
        nodes = "\n".join(
            f"  SuperNode {i}: pid {n.pid}, runtime 127.0.0.1:{self.node_ports[i]}, node config "
            f"{toml_node_config(self.node_configs[i])}"
            for i, n in enumerate(self.nodes)
            if n
        )
        where = f"ip netns exec {self.network.namespace(netns.SUPERLINK)} " if self.network else ""
        return (
            f"SuperLink: pid {self.superlink.pid if self.superlink else '-'}\n"
            f"  Fleet API (gRPC{', TLS' if self.tls else ''}{', node auth' if self.auth else ''}): "
            f"{self.fleet_address}\n"
            f"  Control + Runtime API (HTTP, loopback, this user only): {self.control_address}\n"
            f"  gRPC messages up to {self.max_message_bytes / 2**20:.3g} MiB\n"
            f"  state: {self.database if self.persistent else 'in memory'}\n{nodes}\n"
            + ("Runtime APIs: tasks only for signed requests (SuperExec auth)\n" if self.auth_secret else "")
            + (f"SuperNodes run only the app bundles {', '.join(self.trust_apps)}\n" if self.trust_apps else "")
            + (f"{self.network.describe()}\n" if self.network else "")
            + (
                f"Submit a run from the florist checkout:\n"
                f"  FLWR_HOME={self.flwr_home} FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 "
                f"{where}flwr run . {CONNECTION} --stream --run-config 'min-nodes={len(self.nodes)} ...'\n"
                if submit
                else ""
            )
            + f"Logs: {self.logs}"
        )
