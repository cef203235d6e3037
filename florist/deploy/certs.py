"""Certificates and keys for a secured federation, made with the `cryptography` package that
Flower already depends on: a CA that signs the SuperLink's certificate for the names the
SuperNodes dial (its key is then dropped), and ECDSA key pairs that identify SuperNodes (SuperNode
authentication: the SuperLink knows a node by its registered public key, so a box makes its own
pair and sends only the public half). Everything goes into folders only their owner can change."""

from __future__ import annotations

import datetime
import ipaddress
import os
import stat
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


def key_folder(path: Path) -> Path:
    """`path` as a folder for keys and certificates that only this user can change: made 0700
    (whatever the umask) when missing; an existing one (or what its link names) is refused when
    another user owns it or group/others can write it, since whoever can write there can swap
    `ca.crt` or a key under the federation."""
    try:
        path.mkdir(mode=0o700, parents=True)
        path.chmod(0o700)
        return path
    except FileExistsError:
        pass
    info = path.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"{path} exists and is not a folder: choose another --out")
    if info.st_uid != os.getuid():
        raise PermissionError(
            f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}), who could then swap the "
            "certificates or keys: use a folder of your own"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"{path} is writable by group/others (mode {stat.S_IMODE(info.st_mode):04o}), who could then swap the "
            f"certificates or keys: `chmod 700 {path}` first, or use a new folder"
        )
    return path


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )


def make_ca_and_server(out: Path, hosts: list[str]) -> dict[str, Path]:
    """`ca.crt` and `server.pem`/`server.key` valid for `hosts` (plus 127.0.0.1, which the
    SuperLink's own ServerApp process dials). The CA's key is never written: a CA for one
    federation signs its server certificate and nothing else, since SuperNodes are known by
    their registered public keys, not by certificates."""
    hosts = [h.strip() for h in hosts if h.strip()]
    if not hosts:
        raise ValueError("--hosts: expected the names or IPs the SuperNodes dial, e.g. superlink.example,10.0.0.5")
    hosts = list(dict.fromkeys([*hosts, "127.0.0.1"]))
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
    key_folder(out)
    pem = serialization.Encoding.PEM
    return {
        "ca": _write(out / "ca.crt", ca_cert.public_bytes(pem)),
        "server_cert": _write(out / "server.pem", server_cert.public_bytes(pem)),
        "server_key": _write(out / "server.key", _pem_key(server_key), private=True),
    }


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
    `flower-supernode --auth-supernode-private-key` read): `name` and `name.pub`. A private key
    already there is never replaced: it is a node's identity, and its public half may be
    registered with a SuperLink."""
    if not name or name.startswith(".") or Path(name).name != name:
        raise ValueError(f"node key name {name!r}: expected a plain file name, e.g. node-3 or box1")
    private_path = key_folder(out) / name
    for path in (private_path, out / f"{name}.pub"):  # the .pub stays when the private key went to its box
        if os.path.lexists(path):
            raise FileExistsError(
                f"{path} exists: it is a node's identity (its .pub may be registered with the SuperLink), "
                "so it is never replaced; choose another name, or delete it first"
            )
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return _write(private_path, private, private=True), _write(out / f"{name}.pub", public + b"\n")


def add_node(out: str | Path, name: str) -> tuple[Path, Path]:
    """A key pair for one more box, `keys/NAME` and `keys/NAME.pub`, beside the keys of a folder
    `make_certificates` wrote: the CA is only read for (its `ca.crt` is what the box needs beside
    its key), never made again, so the boxes already out keep theirs. An existing NAME is kept."""
    out = Path(out)
    if not (out / "ca.crt").is_file():
        raise FileNotFoundError(
            f"{out / 'ca.crt'} does not exist: --add-node adds a box to a folder `florist certs --hosts ...` made "
            "(or, on the box itself: florist certs --node-key-only NAME)"
        )
    return make_node_key(key_folder(out) / "keys", name)


def old_ca_key(out: Path) -> str:
    """A note on the `ca.key` an older `florist certs` kept in `out` ("" when there is none): it
    is left alone, but nothing reads it, and whoever does can sign certificates that every box
    holding that CA's `ca.crt` trusts."""
    key = out / "ca.key"
    if not os.path.lexists(key):
        return ""
    return (
        f"{key}, kept by an older florist, is no longer needed and lets whoever reads it impersonate the SuperLink: "
        "delete it"
    )


def make_certificates(out: str | Path, hosts: list[str], num_nodes: int, force: bool = False) -> dict[str, Path]:
    """Everything `florist certs` writes on the SuperLink's machine: CA certificate, SuperLink
    certificate and key, and `keys/node-<i>[.pub]` for `num_nodes` SuperNodes run from there
    (a key already there is kept). A CA already there is kept unless `force`: a new one must be
    copied to every box. Adding a box needs no CA: it makes its own key (`make_node_key`)."""
    out = key_folder(Path(out))
    if os.path.lexists(out / "ca.crt") and not force:
        note = old_ca_key(out)
        raise FileExistsError(
            f"{out / 'ca.crt'} exists: a new CA would have to be copied to every box (--force replaces it; a new box "
            "needs no new CA, only a key: florist certs --add-node NAME --out DIR, or on the box --node-key-only NAME)"
            + (f"; {note}" if note else "")
        )
    paths = make_ca_and_server(out, hosts)
    keys = key_folder(out / "keys") if num_nodes else out / "keys"
    for i in range(num_nodes):
        if not os.path.lexists(keys / f"node-{i}"):
            make_node_key(keys, f"node-{i}")
    return paths
