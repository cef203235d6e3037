"""One remote party cannot exhaust the SuperLink's memory (issue 44, point 3).

Flower 1.39's SuperLink takes gRPC messages up to 2 GiB, 1,000 calls at a time. Measured with this
file's attacks (benchmarks/superlink_memory.py): on an insecure stock `flower-superlink`, 4
concurrent `RegisterNode` calls with a 64 MiB "public key" each were accepted, RSS 139 -> peak
1,508 MiB, 771 MiB two seconds later (the keys are stored); on a TLS + node-auth one, 2 concurrent
256 MiB `PushObject` calls signed by an unregistered key were refused only once the whole body had
arrived, 140 -> peak 1,115 MiB, 555 MiB after. The SuperLink florist starts (`florist superlink`,
by default a 20 MiB receive limit) refuses the same calls from their length prefix: its peak rose
by 5-11 MiB (four runs).

BOUND_MIB, the most the peak may rise, is one of the smaller oversized messages: a SuperLink under
it has not taken in any of them whole. That leaves 6x the largest measured rise for a busier
machine, and it is a fifteenth of what the same calls cost without a limit. The limit bounds each message, not
how many arrive: 16 `RegisterNode` calls with keys just under it are each read whole (the peak is
about calls x limit, and the allocator keeps those pages for reuse), but florist's SuperLink refuses
a key over 512 bytes, so none is kept: a second attack leaves less than half its keys' size behind
(measured: +50 MiB of allocator cache against 304 MiB of keys; stock Flower keeps every key, about
950 MiB per attack).
"""

import pytest
from fleet_flood import MiB, attack, oversized_push, oversized_register, rss_summary
from processes import node_configs, submit

from florist.deploy.certs import make_node_key
from florist.deploy.federation import LocalFederation
from florist.deploy.superlink import message_limit

BOUND_MIB = 64
NODES = 1  # an honest node trains after the attack: one is enough, and each more costs seconds on 2 cores

TOO_LARGE = ("RESOURCE_EXHAUSTED", "larger than max")
ATTACKS = {
    # anyone who reaches an insecure Fleet port may register, with any key it likes
    "insecure": ({}, lambda: [oversized_register(64 * MiB) for _ in range(4)], TOO_LARGE),
    # with node auth, a call from an unregistered key still gets its body read before the refusal
    "tls-auth": ({"tls": True, "auth": True}, lambda: [oversized_push(256 * MiB) for _ in range(2)], TOO_LARGE),
}


@pytest.mark.parametrize("security", ATTACKS)
def test_oversized_fleet_calls_are_refused_early_and_honest_nodes_still_train(security, tmp_path):
    options, requests, (code, detail) = ATTACKS[security]
    with LocalFederation(tmp_path / "fed", node_configs(NODES, tmp_path), **options) as fed:
        stranger, _ = make_node_key(tmp_path / "stranger", "stranger")  # a key the SuperLink never registered
        answers, cost = attack(
            fed.superlink.pid, fed.fleet_address, requests, stranger, fed.certs / "ca.crt" if fed.tls else None
        )
        assert cost.growth < BOUND_MIB, f"SuperLink RSS {rss_summary(cost)}, grew over {BOUND_MIB} MiB: {answers}"
        refused = [a for a in answers if a.code == code and detail in a.details]
        assert len(refused) == len(answers), answers
        assert len(fed.online_nodes()) == NODES
        results = submit(fed, tmp_path / "out", **{"num-server-rounds": 1, "local-epochs": 1})
        assert results["complete"] and results["summary"]["seen"]["num_clients"] == NODES


KEYS = 16


def test_keys_just_under_the_limit_are_refused_and_a_second_attack_leaves_no_key_behind(tmp_path):
    key_mib = message_limit() // MiB - 1  # just under the limit
    with LocalFederation(tmp_path / "fed", node_configs(NODES, tmp_path)) as fed:
        stranger, _ = make_node_key(tmp_path / "stranger", "stranger")
        costs = []
        for _ in range(2):
            requests = lambda: [oversized_register(key_mib * MiB) for _ in range(KEYS)]  # noqa: E731
            answers, cost = attack(fed.superlink.pid, fed.fleet_address, requests, stranger, None)
            assert all(a.code == "INVALID_ARGUMENT" and "SuperNode keys are at most" in a.details for a in answers)
            costs.append(cost)
        # Stored keys would leave all 16 x 19 MiB behind (Flower's own error text quotes each, 4x over);
        # refused ones leave only what the allocator keeps of the buffers, which it reuses.
        left = costs[1].after - costs[0].after
        assert left < KEYS * key_mib / 2, f"first {rss_summary(costs[0])}; second {rss_summary(costs[1])}"
        assert len(fed.online_nodes()) == NODES
