"""The SuperLink florist starts (`florist superlink`): its Control and Runtime APIs answer its own
user only, probed as another uid against a real federation, and who owns a loopback socket is
read right from the kernel's tables."""

import hashlib
import os
import socket
import time

import pytest
from processes import node_configs
from test_join_exposure import NOBODY, as_nobody, outcome

from florist.common.flower_internals import runtime
from florist.common.flower_internals.superlink import socket_owner
from florist.deploy import superlink
from florist.deploy.federation import LocalFederation

TINYAPP = runtime.Path(__file__).parent / "apps" / "tinyapp"


def start_run(address: str, fab: bytes) -> int:
    """What `flwr run` asks the Control API: start a run of the bundle `fab`; its run id."""
    from flwr.common.serde import fab_to_proto
    from flwr.proto.control_pb2 import StartRunRequest
    from flwr.supercore.control import ControlHttpClient
    from flwr.supercore.fab import Fab
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor

    client = ControlHttpClient.from_server_address(
        server_address=address,
        insecure=True,
        root_certificates=None,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr CLI")],
    )
    try:
        bundle = Fab(hashlib.sha256(fab).hexdigest(), fab, {})
        return client.StartRun(StartRunRequest(fab=fab_to_proto(bundle))).run_id
    finally:
        client.close()


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    root = tmp_path_factory.mktemp("guarded")
    with LocalFederation(root, node_configs(1, root), executor="flower") as fed:
        yield fed


def test_another_user_can_neither_list_the_nodes_nor_submit_a_run(federation):
    fab = runtime.fab_bytes(TINYAPP)
    listed = outcome(as_nobody(lambda: runtime.online_node_ids(federation.control_address, None)))
    started = outcome(as_nobody(lambda: start_run(federation.control_address, fab)))
    for answer in (listed, started):
        assert "403 Forbidden" in answer, answer
    assert f"uid {NOBODY}" in federation.superlink.tail(40)  # the refusal is logged, naming who was refused
    # The owner is answered as before: its node is listed, and a run it submits starts.
    assert len(federation.online_nodes()) == 1
    run_id = start_run(federation.control_address, fab)
    assert run_id > 0
    assert federation.flwr("stop", str(run_id), "florist-local").returncode == 0


def test_the_socket_owner_is_the_uid_that_opened_the_socket():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(2)
        address = server.getsockname()
        mine = socket.create_connection(address)
        accepted = [server.accept()[0]]
        assert socket_owner(mine.getsockname(), address) == os.getuid()

        def connect_as_nobody():
            with socket.create_connection(address):
                time.sleep(30)  # held open until the parent has looked (it ends this child)

        child = as_nobody(connect_as_nobody)
        theirs, peer = server.accept()
        accepted.append(theirs)
        assert socket_owner(peer, address) == NOBODY
        assert socket_owner(("127.0.0.1", 1), address) is None  # no such socket: no owner, never this uid
        os.kill(child[0], 15)
        outcome(child)
        for conn in (*accepted, mine):
            conn.close()


def test_the_message_limit_is_sized_from_the_model_within_one_chunk():
    chunk = superlink.chunk_bytes()
    assert superlink.message_limit() == 4 * chunk  # any model: 4 chunks
    assert superlink.message_limit(10 * chunk) == 4 * chunk
    assert superlink.message_limit(2 * 2**20) == 8 * 2**20
    assert superlink.message_limit(1000) == superlink.FLOOR  # a tiny model still has room for its configs


def test_the_pinned_flower_reads_as_the_guard_expects():
    from florist.common.flower_internals import superlink as guard

    assert guard.problems() == []
