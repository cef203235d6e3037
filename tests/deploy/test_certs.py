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


def test_certs_keeps_a_ca_unless_forced_and_never_follows_a_planted_link(tmp_path, capsys):
    args = ["certs", "--out", str(tmp_path), "--hosts", "superlink", "--num-nodes", "1"]
    assert main(args) == 0
    ca = (tmp_path / "ca.key").read_bytes()
    assert main(args) == 2 and "ca.key exists" in capsys.readouterr().err
    assert (tmp_path / "ca.key").read_bytes() == ca
    outside = tmp_path / "outside"
    outside.write_text("keep me")
    (tmp_path / "server.key").unlink()
    (tmp_path / "server.key").symlink_to(outside)  # a link where a private key will be written
    assert main([*args, "--force"]) == 0
    assert outside.read_text() == "keep me" and not (tmp_path / "server.key").is_symlink()
    assert (tmp_path / "ca.key").read_bytes() != ca  # forced: a new CA
    for key in (tmp_path / "ca.key", tmp_path / "server.key", tmp_path / "keys" / "node-0"):
        assert key.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "keys").stat().st_mode & 0o777 == 0o700
