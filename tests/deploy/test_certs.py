import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding

from florist.cli import main


def test_certs_command_makes_a_ca_signed_server_cert_with_the_sans_and_node_keys(tmp_path):
    assert main(["certs", "--out", str(tmp_path), "--hosts", "superlink.example,10.0.0.5", "--num-nodes", "2"]) == 0
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["superlink.example"]
    assert set(sans.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("10.0.0.5"),
        ipaddress.ip_address("127.0.0.1"),
    }
    assert server.issuer == ca.subject
    ca.public_key().verify(
        server.signature, server.tbs_certificate_bytes, padding.PKCS1v15(), server.signature_hash_algorithm
    )
    assert (tmp_path / "server.key").stat().st_mode & 0o077 == 0  # private keys are owner-only
    for i in range(2):
        key = serialization.load_ssh_private_key((tmp_path / "keys" / f"node-{i}").read_bytes(), password=None)
        public = serialization.load_ssh_public_key((tmp_path / "keys" / f"node-{i}.pub").read_bytes())
        assert isinstance(key.curve, ec.SECP384R1) and key.public_key() == public
