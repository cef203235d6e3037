"""A TLS + SuperNode-auth federation of real processes: training over the encrypted Fleet
connection, and the refusals a wrong key or CA get."""

import pytest
from processes import connected_pids, labelled_folder, node_configs, submit

from florist.deploy.certs import make_ca_and_server, make_node_key
from florist.deploy.federation import LocalFederation
from florist.deploy.join import JoinError, join


@pytest.fixture(scope="module")
def secure_federation(tmp_path_factory):
    """Two SuperNodes: enough for a round of FedAvg over TLS with authentication (each more
    costs a key registration and a warm executor's start)."""
    root = tmp_path_factory.mktemp("tls")
    with LocalFederation(root, node_configs(2, root), tls=True, auth=True) as fed:
        yield fed


def test_tls_auth_federation_trains_over_the_fleet_connection(secure_federation, tmp_path):
    fed = secure_federation
    on_fleet = connected_pids(fed.fleet_port)
    assert all(node.pid in on_fleet for node in fed.nodes)  # each SuperNode holds a gRPC connection to the Fleet port
    results = submit(fed, tmp_path / "out", **{"num-server-rounds": 1})
    assert results["complete"] and results["summary"]["seen"]["num_clients"] == 2


def test_unregistered_key_is_refused_clearly(secure_federation, tmp_path):
    stranger, _ = make_node_key(tmp_path, "stranger")
    with pytest.raises(JoinError, match="not registered.*flwr supernode register"):
        join(
            secure_federation.fleet_address,
            labelled_folder(tmp_path / "data"),
            root_certificates=secure_federation.certs / "ca.crt",
            auth_key=stranger,
            max_wait_time=20,
        )


def test_node_without_the_right_ca_cannot_connect(secure_federation, tmp_path):
    other_ca = make_ca_and_server(tmp_path / "other", ["localhost"])["ca"]
    with pytest.raises(JoinError, match="does not verify"):
        join(
            secure_federation.fleet_address,
            labelled_folder(tmp_path / "data"),
            root_certificates=other_ca,
            auth_key=secure_federation.node_key(0)[0],
            max_wait_time=20,
        )


def test_joining_a_tls_superlink_without_a_ca_says_it_needs_tls(secure_federation, tmp_path):
    with pytest.raises(JoinError, match="speaks TLS: pass --root-certificates"):
        join(secure_federation.fleet_address, labelled_folder(tmp_path / "data"), insecure=True, max_wait_time=20)
