import ipaddress
import os
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding

from florist.cli import main


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def error_line(capsys) -> str:
    """The one line a refused command prints (and nothing else)."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("florist: error: "), err
    return err


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
    assert not (tmp_path / "ca.key").exists()  # the CA signed the SuperLink's certificate and nothing more
    for i in range(2):
        key = serialization.load_ssh_private_key((tmp_path / "keys" / f"node-{i}").read_bytes(), password=None)
        public = serialization.load_ssh_public_key((tmp_path / "keys" / f"node-{i}.pub").read_bytes())
        assert isinstance(key.curve, ec.SECP384R1) and key.public_key() == public


def test_certs_keeps_a_ca_unless_forced_and_never_follows_a_planted_link(tmp_path, capsys):
    args = ["certs", "--out", str(tmp_path), "--hosts", "superlink", "--num-nodes", "1"]
    assert main(args) == 0
    ca, node = (tmp_path / "ca.crt").read_bytes(), (tmp_path / "keys" / "node-0").read_bytes()
    assert main(args) == 2 and "ca.crt exists" in error_line(capsys)
    assert (tmp_path / "ca.crt").read_bytes() == ca
    outside = tmp_path / "outside"
    outside.write_text("keep me")
    (tmp_path / "server.key").unlink()
    (tmp_path / "server.key").symlink_to(outside)  # a link where a private key will be written
    assert main([*args, "--force"]) == 0
    assert outside.read_text() == "keep me" and not (tmp_path / "server.key").is_symlink()
    assert (tmp_path / "ca.crt").read_bytes() != ca  # forced: a new CA
    assert (tmp_path / "keys" / "node-0").read_bytes() == node  # a node's identity outlives the CA
    assert not (tmp_path / "ca.key").exists()
    for key in (tmp_path / "server.key", tmp_path / "keys" / "node-0"):
        assert mode(key) == 0o600
    assert mode(tmp_path / "keys") == 0o700


def test_certs_makes_its_folders_0700_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        assert main(["certs", "--out", str(tmp_path / "new" / "certs"), "--hosts", "superlink"]) == 0
        assert main(["certs", "--out", str(tmp_path / "box"), "--node-key-only", "box1"]) == 0
    finally:
        os.umask(old)
    for folder in ("new/certs", "new/certs/keys", "box"):
        assert mode(tmp_path / folder) == 0o700, folder


@pytest.mark.parametrize("folder", [".", "keys"])
@pytest.mark.parametrize("loose", [0o777, 0o770, 0o1777], ids=lambda m: f"{m:04o}")
def test_certs_refuses_a_folder_others_can_write_and_writes_nothing_there(tmp_path, capsys, folder, loose):
    out = tmp_path / "certs"
    (out / folder).mkdir(parents=True)
    (out / folder).chmod(loose)  # another user could swap ca.crt or a key there
    assert main(["certs", "--out", str(out), "--hosts", "superlink"]) == 2
    err = error_line(capsys)
    assert f"{out / folder if folder == 'keys' else out} is writable by group/others (mode {loose:04o})" in err
    assert not (out / "keys" / "node-0").exists() and mode(out / folder) == loose  # left as it was
    assert main(["certs", "--out", str(out / folder), "--node-key-only", "box1"]) == 2
    assert "writable by group/others" in error_line(capsys) and not (out / folder / "box1").exists()


def test_certs_refuses_a_folder_of_another_user(tmp_path, capsys, monkeypatch):
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)  # the folder is then someone else's
    assert main(["certs", "--out", str(tmp_path), "--node-key-only", "box1"]) == 2
    assert f"belongs to uid {uid}, not to this user (uid {uid + 1})" in error_line(capsys)
    assert not (tmp_path / "box1").exists()


def test_a_box_makes_its_own_key_pair_and_never_loses_it(tmp_path, capsys):
    args = ["certs", "--out", str(tmp_path / "keys"), "--node-key-only", "box1"]
    assert main(args) == 0  # no --hosts: a box has no certificate to make
    out = capsys.readouterr().out
    assert "flwr supernode register box1.pub <connection>" in out
    assert sorted(p.name for p in (tmp_path / "keys").iterdir()) == ["box1", "box1.pub"]  # no CA, no server
    key = serialization.load_ssh_private_key((tmp_path / "keys" / "box1").read_bytes(), password=None)
    public = serialization.load_ssh_public_key((tmp_path / "keys" / "box1.pub").read_bytes())
    assert key.public_key() == public and mode(tmp_path / "keys" / "box1") == 0o600
    private = (tmp_path / "keys" / "box1").read_bytes()
    assert main(args) == 2 and "box1 exists" in error_line(capsys)
    assert (tmp_path / "keys" / "box1").read_bytes() == private
    for wrong in (["--node-key-only", "../box2"], ["--node-key-only", "box2", "--force"], ["--node-key-only", ""]):
        assert main(["certs", "--out", str(tmp_path), *wrong]) == 2
        error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys"]


def test_a_fourth_box_is_added_later_without_force_and_without_a_ca_key(tmp_path, capsys):
    certs = tmp_path / "certs"
    assert main(["certs", "--out", str(certs), "--hosts", "superlink", "--num-nodes", "3"]) == 0
    kept = [certs / "ca.crt", certs / "server.pem", certs / "keys" / "node-0"]
    before = [path.read_bytes() for path in kept]
    assert main(["certs", "--out", str(certs / "keys"), "--node-key-only", "node-3"]) == 0
    assert "flwr supernode register node-3.pub" in capsys.readouterr().out
    assert [path.read_bytes() for path in kept] == before  # the boxes keep their CA and keys
    assert sorted(p.name for p in (certs / "keys").iterdir()) == [
        f"node-{i}{s}" for i in range(4) for s in ("", ".pub")
    ]


def test_a_superlink_only_folder_has_no_node_keys(tmp_path):
    assert main(["certs", "--out", str(tmp_path), "--hosts", "superlink", "--num-nodes", "0"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.crt", "server.key", "server.pem"]


def test_a_ca_key_left_by_an_older_florist_is_left_alone_and_named(tmp_path, capsys):
    assert main(["certs", "--out", str(tmp_path), "--hosts", "superlink", "--num-nodes", "0"]) == 0
    (tmp_path / "ca.key").write_bytes(b"old CA key")
    capsys.readouterr()
    assert main(["certs", "--out", str(tmp_path), "--hosts", "superlink"]) == 2
    assert "ca.key, kept by an older florist, is no longer needed" in error_line(capsys)
    assert main(["certs", "--out", str(tmp_path), "--hosts", "superlink", "--force"]) == 0
    assert "ca.key, kept by an older florist, is no longer needed" in capsys.readouterr().out
    assert (tmp_path / "ca.key").read_bytes() == b"old CA key"


def test_add_node_adds_a_box_beside_the_others_from_the_kept_ca(tmp_path, capsys):
    certs = tmp_path / "certs"
    assert main(["certs", "--out", str(certs), "--hosts", "superlink", "--num-nodes", "3"]) == 0
    kept = {path: path.read_bytes() for path in [certs / "ca.crt", certs / "server.pem", certs / "keys" / "node-0"]}
    capsys.readouterr()
    assert main(["certs", "--add-node", "box4", "--out", str(certs)]) == 0
    out = capsys.readouterr().out
    assert f"{certs / 'keys' / 'box4'} (its private key" in out and str(certs / "ca.crt") in out
    assert f"florist nodes register --certs {certs}" in out and "--auth-key box4" in out
    assert {path: path.read_bytes() for path in kept} == kept and not (certs / "ca.key").exists()
    key = serialization.load_ssh_private_key((certs / "keys" / "box4").read_bytes(), password=None)
    assert key.public_key() == serialization.load_ssh_public_key((certs / "keys" / "box4.pub").read_bytes())
    assert mode(certs / "keys" / "box4") == 0o600
    private = (certs / "keys" / "box4").read_bytes()
    assert main(["certs", "--add-node", "box4", "--out", str(certs)]) == 2 and "box4 exists" in error_line(capsys)
    assert (certs / "keys" / "box4").read_bytes() == private  # a box's identity is never replaced
    public = (certs / "keys" / "box4.pub").read_bytes()
    (certs / "keys" / "box4").unlink()  # copied to its box and deleted here, as the command advises
    assert main(["certs", "--add-node", "box4", "--out", str(certs)]) == 2 and "box4.pub exists" in error_line(capsys)
    assert (certs / "keys" / "box4.pub").read_bytes() == public  # what the SuperLink registered stays
    assert main(["certs", "--add-node", "box5", "--out", str(certs), "--force"]) == 2
    assert "--add-node makes one key pair" in error_line(capsys)


def test_add_node_needs_the_folder_with_the_ca(tmp_path, capsys):
    assert main(["certs", "--add-node", "box4", "--out", str(tmp_path)]) == 2
    assert f"{tmp_path / 'ca.crt'} does not exist" in error_line(capsys)
    assert list(tmp_path.iterdir()) == []
