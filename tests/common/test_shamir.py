"""florist's rebuild of Shamir-shared secrets against Flower's (pycryptodome's) own."""

import os
import random

import pytest
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares

from florist.common import shamir


@pytest.mark.parametrize(("t", "n", "size"), [(2, 3, 1), (3, 5, 32), (11, 20, 48), (26, 50, 32)])
def test_any_t_shares_rebuild_the_secret_flowers_combine_rebuilds(t, n, size):
    rng = random.Random(t * n)
    for _ in range(3):
        secret = os.urandom(size)
        shares = create_shares(secret, t, n)
        chosen = rng.sample(shares, t)  # any t holders, in any order
        assert shamir.combine(chosen) == combine_shares(chosen) == secret


def test_secrets_shared_among_the_same_holders_reuse_their_weights_and_stay_apart():
    shamir.weights_at_zero.cache_clear()
    secrets = [os.urandom(32) for _ in range(5)]
    shared = [create_shares(s, 3, 5) for s in secrets]
    assert [shamir.combine(s[1:4]) for s in shared] == secrets
    assert shamir.weights_at_zero.cache_info().misses == 1  # one set of holders: one set of weights


def test_field_arithmetic_inverts_and_agrees_with_pycryptodomes():
    from Crypto.Protocol.SecretSharing import _Element  # the reference, private to pycryptodome

    rng = random.Random(0)
    for _ in range(20):
        a, b = rng.getrandbits(128), rng.getrandbits(128)
        assert shamir.multiply(a, b) == int(_Element(a) * _Element(b))
        assert shamir.multiply(a, shamir.inverse(a)) == 1
    with pytest.raises(ValueError):
        shamir.inverse(0)


@pytest.mark.parametrize(
    "broken",
    [
        lambda s: [s[0], s[0], s[2]],  # one holder's share twice
        lambda s: [s[0], s[1], s[2][:-16]],  # a share cut short
        lambda s: [s[0], s[1], s[2][:4]],  # an index alone
        lambda s: [s[0], s[1], bytes(4) + s[2][4:]],  # a share at index 0, where the secret is
    ],
)
def test_shares_that_cannot_rebuild_a_secret_are_refused(broken):
    with pytest.raises(ValueError):
        shamir.combine(broken(create_shares(os.urandom(32), 3, 5)))


def test_a_wrong_share_rebuilds_another_secret_or_none():
    secret = os.urandom(32)
    shares = create_shares(secret, 3, 5)
    tampered = shares[2][:4] + bytes(b ^ 1 for b in shares[2][4:])
    try:
        assert shamir.combine([shares[0], shares[1], tampered]) != secret
    except ValueError:
        pass  # its padding did not survive: refused
