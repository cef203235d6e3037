from florist.deploy.join import diagnose

FACTS = {"superlink": "10.0.0.5:9092", "ca": "ca.crt", "wait": 60.0, "pub": "node-0.pub"}


def test_known_supernode_failures_are_explained():
    assert "not registered" in diagnose("[code: 2004] Failed to activate SuperNode.", **FACTS)
    assert "flwr supernode register node-0.pub" in diagnose("[code: 2004] Failed", **FACTS)
    assert "still online there" in diagnose("[code: 2004] Failed", **FACTS)  # the other cause of the same code
    assert "does not verify against ca.crt" in diagnose("... certificate signature failure ...", **FACTS)
    assert "cannot reach the SuperLink at 10.0.0.5:9092" in diagnose("Connection attempt failed, retrying", **FACTS)
    assert diagnose("something else entirely", **FACTS) is None


def test_the_most_specific_diagnosis_wins():
    # a TLS failure is also followed by failed connection attempts: the cause is the certificate
    output = "SSL/TLS handshake error detected.\nConnection attempt failed, retrying in 2 s"
    assert "does not verify" in diagnose(output, **FACTS)
