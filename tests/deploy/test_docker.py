"""No Docker engine runs here: validate the compose file with the Compose v2 binary and lint the
Dockerfiles with hadolint, both from PyPI (dev extra)."""

import json
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


def compose_config(compose_file: Path, certs: Path, *options: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "FLORIST_CERTS": str(certs), "FLORIST_TRUST_APP": TRUSTED}
    return subprocess.run(
        [str(COMPOSE), "-f", str(compose_file), "config", *(options or ("-q",))],
        capture_output=True,
        text=True,
        env=env,
    )


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


def test_only_the_fleet_port_faces_the_network():
    text = (DOCKER / "compose.yaml").read_text()
    assert '"${FLORIST_FLEET_PORT:-9092}:9092"' in text and '"127.0.0.1:${FLORIST_CONTROL_PORT:-8000}:8000"' in text
    assert '"${FLORIST_CONTROL_PORT:-8000}:8000"' not in text and "9094:" not in text


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
    result = compose_config(DOCKER / "compose.yaml", certs, "--format", "json")
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    superlink = services["superlink"]
    host = next(a.split("=", 1)[1] for a in superlink["command"] if a.startswith("--host="))
    control = [n for n, c in superlink["networks"].items() if host in ((c or {}).get("aliases") or [])]
    assert len(control) == 1 and superlink["networks"][control[0]].get("gw_priority", 0) > 0  # where 8000 is published
    fleet = [n for n in superlink["networks"] if n != control[0]]
    nodes = {name: set(s["networks"]) for name, s in services.items() if name.startswith("supernode-")}
    assert len(nodes) == 3 and all(networks == set(fleet) for networks in nodes.values()), nodes
    assert set(services["superexec-serverapp"]["networks"]) == set(control)  # the ServerApp's runtime reaches it
    assert "--fleet-api-address=0.0.0.0:9092" in superlink["command"]


@pytest.mark.parametrize("dockerfile", sorted(DOCKER.glob("**/Dockerfile*")), ids=lambda p: p.name)
def test_dockerfiles_pass_hadolint(dockerfile):
    result = subprocess.run([str(HADOLINT), str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_can_fail(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")
    assert subprocess.run([str(HADOLINT), str(bad)], capture_output=True).returncode != 0
