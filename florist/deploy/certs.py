"""Certificates and keys for a secured federation, made with the `cryptography` package that
Flower already depends on: a CA, a SuperLink certificate for the names the SuperNodes dial,
and one ECDSA key pair per SuperNode for SuperNode authentication."""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 365


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "florist"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    """`data` at `path`, created with its final mode (a private key is never readable by others,
    not even for a moment) under a new name, then renamed over `path`: a link planted there is
    replaced, never followed."""
    staged = path.with_name(f".{path.name}.{os.getpid()}.new")
    staged.unlink(missing_ok=True)
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    os.replace(staged, path)
    return path


def _folder(path: Path) -> Path:
    """A folder for keys: made readable by its owner only."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )


def make_ca_and_server(out: Path, hosts: list[str], keep_ca_key: bool = True) -> dict[str, Path]:
    """`ca.crt`/`ca.key` and `server.pem`/`server.key` valid for `hosts` (plus 127.0.0.1, which
    the SuperLink's own ServerApp process dials). Without `keep_ca_key`, the CA's key is never
    written: a CA for one federation signs its server certificate and nothing else."""
    hosts = list(dict.fromkeys([h.strip() for h in hosts if h.strip()] + ["127.0.0.1"]))
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)

    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("florist CA"))
        .issuer_name(_name("florist CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca_cert.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _folder(out)
    pem = serialization.Encoding.PEM
    written = {
        "ca": _write(out / "ca.crt", ca_cert.public_bytes(pem)),
        "server_cert": _write(out / "server.pem", server_cert.public_bytes(pem)),
        "server_key": _write(out / "server.key", _pem_key(server_key), private=True),
    }
    if keep_ca_key:
        written["ca_key"] = _write(out / "ca.key", _pem_key(ca_key), private=True)
    return written


def covers(server_cert: Path, hosts: list[str]) -> bool:
    """Whether the certificate at `server_cert` exists and names every one of `hosts` in its
    SAN: one made for another address (a network since remade) must be made again."""
    if not server_cert.exists():
        return False
    names = (
        x509.load_pem_x509_certificate(server_cert.read_bytes())
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value
    )
    return all(_san(h) in names for h in hosts)


def make_node_key(out: Path, name: str) -> tuple[Path, Path]:
    """An ECDSA P-384 key pair in OpenSSH format (what `flwr supernode register` and
    `flower-supernode --auth-supernode-private-key` read): `name` and `name.pub`."""
    key = ec.generate_private_key(ec.SECP384R1())
    _folder(out)
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return _write(out / name, private, private=True), _write(out / f"{name}.pub", public + b"\n")


def make_certificates(out: str | Path, hosts: list[str], num_nodes: int, force: bool = False) -> dict[str, Path]:
    """Everything `florist certs` writes: CA, SuperLink certificate, `keys/node-<i>[.pub]`. A CA
    already there is kept unless `force`: replacing it would orphan every certificate it signed."""
    out = Path(out)
    if (out / "ca.key").exists() and not force:
        raise FileExistsError(f"{out / 'ca.key'} exists: a new CA would orphan what it signed (--force replaces it)")
    paths = make_ca_and_server(out, hosts)
    for i in range(num_nodes):
        make_node_key(out / "keys", f"node-{i}")
    return paths
