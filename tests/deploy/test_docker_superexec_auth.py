"""The compose stack gives its Runtime APIs SuperExec auth secrets, as `deploy-local` does: the
SuperLink and the ServerApp's SuperExec share one, each SuperNode has its own, and no SuperNode
holds the SuperLink's (code that a node runs could otherwise take the server's tasks).
`docker/e2e.sh` checks on a running stack that unsigned task requests are refused."""

import json

import pytest

from tests.deploy.test_docker import DOCKER, compose_config

FLAG = "--superexec-auth-secret-file="


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    result = compose_config(DOCKER / "compose.yaml", tmp_path_factory.mktemp("certs"), "--format", "json")
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    return {name: (service, config["secrets"]) for name, service in config["services"].items()}


def secret_of(service: dict, secrets: dict) -> tuple[str, str]:
    """(the secret's name, its file on the host) that the service's command signs or checks with."""
    path = next(a.removeprefix(FLAG) for a in service["command"] if a.startswith(FLAG))
    mounted = {(s["source"] if isinstance(s, dict) else s): s for s in service["secrets"]}
    name = path.removeprefix("/run/secrets/")
    assert name in mounted, (path, list(mounted))
    return name, secrets[name]["file"]


def test_the_superlink_and_its_superexec_share_a_secret(services):
    superlink, superexec = (secret_of(*services[name]) for name in ("superlink", "superexec-serverapp"))
    assert superlink == superexec and superlink[1].endswith("/superexec-auth/superlink")


def test_each_supernode_has_its_own_secret_and_not_the_superlinks(services):
    superlink_secret = secret_of(*services["superlink"])[0]
    nodes = {name: s for name, s in services.items() if name.startswith("supernode-")}
    assert len(nodes) == 3
    files = {secret_of(*s)[1] for s in nodes.values()}
    assert len(files) == 3 and secret_of(*services["superlink"])[1] not in files
    for name, (service, _) in nodes.items():
        assert superlink_secret not in [s["source"] if isinstance(s, dict) else s for s in service["secrets"]], name
