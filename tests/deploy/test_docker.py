"""No Docker engine runs here: validate the compose file with the Compose v2 binary and lint the
Dockerfiles with hadolint, both from PyPI (dev extra)."""

import fnmatch
import json
import re
import subprocess
import sys
from pathlib import Path

import compose
import pytest

from florist.deploy.certs import make_certificates

DOCKER = Path(__file__).parents[2] / "docker"
COMPOSE = Path(compose.__file__).parent / "docker-compose"  # the Go binary, not the always-0 wrapper
HADOLINT = Path(sys.executable).parent / "hadolint"
TRUSTED = "ab" * 32  # a bundle's sha256 (`florist app-hash`), which compose's SuperNodes require


def compose_config(
    compose_file: Path | list[Path], certs: Path, *options: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    files = compose_file if isinstance(compose_file, list) else [compose_file]
    env = {"PATH": "/usr/bin:/bin", "FLORIST_CERTS": str(certs), "FLORIST_TRUST_APP": TRUSTED, **(env or {})}
    return subprocess.run(
        [str(COMPOSE), *(a for f in files for a in ("-f", str(f))), "config", *(options or ("-q",))],
        capture_output=True,
        text=True,
        env=env,
    )


def services_of(*files: Path, certs: Path, env: dict[str, str] | None = None) -> dict:
    """The resolved stack (every profile's services too), as compose would run it."""
    result = compose_config(list(files), certs, "--format", "json", env={"COMPOSE_PROFILES": "cli", **(env or {})})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    make_certificates(out, ["superlink", "localhost"], 3)
    return out


def test_compose_file_is_valid(certs):
    result = compose_config(DOCKER / "compose.yaml", certs)
    assert result.returncode == 0, result.stderr


def test_the_validator_catches_a_broken_compose_file(certs, tmp_path):
    broken = tmp_path / "compose.yaml"
    broken.write_text((DOCKER / "compose.yaml").read_text().replace("condition: service_healthy", "condition: healthy"))
    assert compose_config(broken, certs).returncode != 0


def test_only_the_fleet_port_is_published_unless_asked(certs):
    """By default the host gets the Fleet API alone; control-port.yaml adds the Control/Runtime API
    on its loopback only, and says in its header that every local user can then submit runs."""
    published = {
        name: [(p.get("host_ip", ""), p["target"]) for p in s.get("ports", [])]
        for name, s in services_of(DOCKER / "compose.yaml", certs=certs)["services"].items()
        if s.get("ports")
    }
    assert published == {"superlink": [("", 9092)]}
    override = DOCKER / "control-port.yaml"
    ports = services_of(DOCKER / "compose.yaml", override, certs=certs)["services"]["superlink"]["ports"]
    assert sorted((p.get("host_ip", ""), p["target"]) for p in ports) == [("", 9092), ("127.0.0.1", 8000)]
    assert "every local user of this host can then submit runs" in override.read_text().lower()


def test_every_supernode_runs_only_the_trusted_app_and_the_stack_needs_it_named(certs, tmp_path):
    """Compose's SuperNodes refuse any bundle but FLORIST_TRUST_APP's (`--trust-app`); without it
    named, `docker compose` stops with the command that prints it instead of starting nodes
    that would run whatever the SuperLink sends."""
    result = compose_config(DOCKER / "compose.yaml", certs, "--format", "json")
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    nodes = [s for name, s in services.items() if name.startswith("supernode-")]
    assert len(nodes) == 3 and all(f"--trust-app={TRUSTED}" in s["entrypoint"] for s in nodes)
    env = {"PATH": "/usr/bin:/bin", "FLORIST_CERTS": str(certs)}
    unset = subprocess.run(
        [str(COMPOSE), "-f", str(DOCKER / "compose.yaml"), "config", "-q"], capture_output=True, text=True, env=env
    )
    assert unset.returncode != 0 and "florist app-hash" in unset.stderr


def test_no_supernode_shares_a_network_with_the_control_api(certs):
    """The SuperLink's Control/Runtime API (run submission: a run executes on every node) listens
    on an address of a network that no SuperNode is on; the Fleet API is on the SuperNodes' one."""
    services = services_of(DOCKER / "compose.yaml", certs=certs)["services"]
    superlink = services["superlink"]
    host = next(a.split("=", 1)[1] for a in superlink["command"] if a.startswith("--host="))
    control = [n for n, c in superlink["networks"].items() if host in ((c or {}).get("aliases") or [])]
    assert len(control) == 1
    fleet = [n for n in superlink["networks"] if n != control[0]]
    nodes = {name: set(s["networks"]) for name, s in services.items() if name.startswith("supernode-")}
    assert len(nodes) == 3 and all(networks == set(fleet) for networks in nodes.values()), nodes
    for client in ("superexec-serverapp", "flwr"):  # the ServerApp's runtime and the CLI reach it
        assert set(services[client]["networks"]) == set(control), client
    assert "--fleet-api-address=0.0.0.0:9092" in superlink["command"]


def test_the_host_has_no_address_on_the_control_network(certs):
    """Docker gives the host an address on each bridge network, from which any local user reaches
    every container on it: `control` is internal and inhibits that address, so 8000 is reached
    from containers on it only; control-port.yaml makes it an ordinary bridge again."""
    control = services_of(DOCKER / "compose.yaml", certs=certs)["networks"]["control"]
    assert control.get("internal") is True
    assert control["driver_opts"]["com.docker.network.bridge.inhibit_ipv4"] == "true"
    published = services_of(DOCKER / "compose.yaml", DOCKER / "control-port.yaml", certs=certs)
    assert not published["networks"]["control"].get("internal")
    assert published["networks"]["control"]["driver_opts"]["com.docker.network.bridge.inhibit_ipv4"] == "false"


def test_the_flwr_service_is_the_cli_on_the_control_network(certs):
    """`docker compose run --rm flwr ...`: the image's flwr, started only on demand (profile cli),
    with a connection `docker` to the SuperLink's Control API over TLS and no private key."""
    cli = services_of(DOCKER / "compose.yaml", certs=certs)["services"]["flwr"]
    assert cli["profiles"] == ["cli"] and cli["image"] == "florist-superexec:0.1.0"
    script = cli["entrypoint"][2]
    assert cli["entrypoint"][:2] == ["sh", "-c"] and script.endswith('exec flwr "$$@"')
    for line in (
        "'[superlink.docker]'",
        "'address = \"superlink:8000\"'",
        "'root-certificates = \"/run/secrets/ca.crt\"'",
    ):
        assert line in script, line
    assert [s["source"] for s in cli["secrets"]] == ["ca.crt"]
    assert {c["target"] for c in cli["configs"]} == {f"/keys/node-{i}.pub" for i in range(3)}


def test_the_superlink_refuses_oversized_messages(certs):
    """florist's SuperLink (flower-superlink's options, plus a gRPC receive limit), the limit
    4 MiB unless FLORIST_MAX_MESSAGE_MB says otherwise."""
    superlink = services_of(DOCKER / "compose.yaml", certs=certs)["services"]["superlink"]
    assert superlink["entrypoint"] == ["florist", "superlink"]
    assert "--max-message-mb=4" in superlink["command"]
    larger = services_of(DOCKER / "compose.yaml", certs=certs, env={"FLORIST_MAX_MESSAGE_MB": "20"})
    assert "--max-message-mb=20" in larger["services"]["superlink"]["command"]


def test_every_service_has_a_memory_limit_that_the_environment_moves(certs):
    services = services_of(DOCKER / "compose.yaml", certs=certs)["services"]
    assert len(services) == 6 and all(int(s.get("mem_limit") or 0) > 0 for s in services.values()), {
        n: s.get("mem_limit") for n, s in services.items()
    }
    env = {"FLORIST_SUPERLINK_MEMORY": "3g", "FLORIST_SUPERNODE_MEMORY": "5g"}
    moved = services_of(DOCKER / "compose.yaml", certs=certs, env=env)["services"]
    assert int(moved["superlink"]["mem_limit"]) == 3 * 2**30 and int(moved["supernode-2"]["mem_limit"]) == 5 * 2**30


def test_each_container_mounts_only_the_keys_it_uses(certs):
    """A private key reaches only the container that signs or serves with it, and no container
    mounts the certificates folder itself."""
    config = services_of(DOCKER / "compose.yaml", certs=certs)
    mounted = {name: {s["source"] for s in service.get("secrets", [])} for name, service in config["services"].items()}
    assert mounted == {
        "superlink": {"ca.crt", "server.pem", "server.key", "superexec-auth-superlink"},
        "superexec-serverapp": {"ca.crt", "superexec-auth-superlink"},
        **{f"supernode-{i}": {"ca.crt", f"node-{i}", f"superexec-auth-node-{i}"} for i in range(3)},
        "flwr": {"ca.crt"},
    }
    binds = [v for s in config["services"].values() for v in s.get("volumes", []) if v["type"] == "bind"]
    assert not binds, binds


def test_the_docs_give_the_images_group_exactly_the_private_files_compose_mounts(certs):
    """docs/deployment.md's `chgrp` (so compose.yaml's header and e2e.sh) names every private file a container mounts,
    and nothing else: the CA, the other keys and whatever else is in the folder stay the operator's."""
    config = services_of(DOCKER / "compose.yaml", certs=certs)
    prefix = f"{certs}/"
    public = ("ca.crt", "server.pem")
    private = {
        f.removeprefix(prefix)
        for n, s in config["secrets"].items()
        if (f := s["file"]).startswith(prefix) and n not in public
    }
    docs = (DOCKER.parent / "docs" / "deployment.md").read_text()
    lines = [re.search(rf"^{command} (.+?)\s*(#.*)?$", docs, re.M) for command in ("sudo chgrp 49999", "chmod 0640")]
    assert all(lines), "no `sudo chgrp 49999 ...` and `chmod 0640 ...` lines in docs/deployment.md"
    named = [p.removeprefix("docker/certs/") for p in lines[0][1].split()]
    assert lines[1][1].split() == lines[0][1].split()
    assert f"#   sudo chgrp 49999 {lines[0][1]}\n" in (DOCKER / "compose.yaml").read_text()  # its header's steps
    candidates = private | {"ca.key", "keys/node-3", "keys/node-0.pub", "server.pem", "ca.crt"}
    assert {c for c in candidates if any(fnmatch.fnmatchcase(c, n) for n in named)} == private
    e2e = (DOCKER / "e2e.sh").read_text()
    assert 'chgrp 49999 "${private[@]}" && chmod 0640 "${private[@]}"' in e2e


@pytest.mark.parametrize("dockerfile", sorted(DOCKER.glob("**/Dockerfile*")), ids=lambda p: p.name)
def test_dockerfiles_pass_hadolint(dockerfile):
    result = subprocess.run([str(HADOLINT), str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_can_fail(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")
    assert subprocess.run([str(HADOLINT), str(bad)], capture_output=True).returncode != 0
