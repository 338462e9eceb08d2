"""A run's TLS files: one run certificate authority, and one certificate and key that every participant shares.

Trust model. The run token already decides who is in a run; TLS adds encryption, and keeps out of the gRPC
servers anyone who lacks the run's files. So the run owner makes, once per run (`geotrain tls init DIR`):

- ca.pem: a certificate authority made for this run alone; its private key is thrown away once it has signed
  cert.pem, so nothing else can ever be signed by it and there is no CA key to guard;
- cert.pem and key.pem: the one certificate (and its key) that the coordinator and every node present, both as a
  server and as a client, named RUN_TLS_NAME.

and hands DIR to every participant beside the token. Every server requires a client certificate signed by the
run CA (mutual TLS), and every client checks the server's certificate against the run CA under RUN_TLS_NAME
rather than the host it dials: nodes are dialled by whatever IP:port they advertise, which no certificate made in
advance could list. Whoever holds key.pem can take part in the run's TLS, as whoever holds the token can in the
run, so the directory is as secret as the token; to shut someone out, make new files and a new token and restart.

Files from another CA work too if the certificate names RUN_TLS_NAME (subjectAltName DNS) and allows both server
and client authentication.
"""

from __future__ import annotations

import datetime
import os
import socket
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

RUN_TLS_NAME = "geotrain-run"
"""The name every run certificate carries and every channel expects, whatever address it dials."""
CA_FILE, CERT_FILE, KEY_FILE = "ca.pem", "cert.pem", "key.pem"
# Long enough to outlive any run; backdated so that a machine whose clock is a little behind accepts it at once.
_VALID_DAYS = 3650
_BACKDATE = datetime.timedelta(days=1)


@dataclass(frozen=True, kw_only=True)
class TlsFiles:
    """The contents of a run's TLS files (PEM): every process serves with cert and key, presents them as a client,
    and accepts only peers whose certificate the run CA signed."""

    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, directory: str | Path) -> TlsFiles:
        """Read and check ca.pem, cert.pem and key.pem in directory; raises ValueError naming what is wrong."""
        directory = Path(directory)
        if not directory.is_dir():
            raise ValueError(f"TLS directory {directory} does not exist (make one with `geotrain tls init DIR`)")
        contents = {}
        for name in (CA_FILE, CERT_FILE, KEY_FILE):
            path = directory / name
            if not path.is_file():
                raise ValueError(f"TLS directory {directory} has no {name} (make one with `geotrain tls init DIR`)")
            contents[name] = path.read_bytes()
        files = cls(ca=contents[CA_FILE], cert=contents[CERT_FILE], key=contents[KEY_FILE])
        _check(files, directory)
        return files


def ssl_context(files: TlsFiles, *, server: bool) -> ssl.SSLContext:
    """Python ssl's context for a connection of the run outside gRPC (the raw tensor stream), with the trust model of
    its channels: both ends present the run certificate and accept only peers the run CA signed; a client expects
    RUN_TLS_NAME (pass it as server_hostname)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=files.ca.decode())
    # ssl loads a certificate and key from files only: a private directory, removed once they are read.
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "run.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(files.key + b"\n" + files.cert)
        context.load_cert_chain(path)
    return context


def _check(files: TlsFiles, directory: Path) -> None:
    """Refuse files that could never complete a handshake, with the reason, rather than fail at every call."""
    try:
        ca = x509.load_pem_x509_certificate(files.ca)
        cert = x509.load_pem_x509_certificate(files.cert)
    except ValueError:
        raise ValueError(f"{directory / CA_FILE} or {directory / CERT_FILE} is not a PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(files.key, password=None)
    except (ValueError, TypeError):
        raise ValueError(f"{directory / KEY_FILE} is not an unencrypted PEM private key") from None
    if key.public_key() != cert.public_key():
        raise ValueError(f"{directory / KEY_FILE} is not the key of {directory / CERT_FILE}")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise ValueError(f"{directory / CERT_FILE} is not signed by {directory / CA_FILE} (files of two runs?)") from None
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName
        )
    except x509.ExtensionNotFound:
        names = []
    if RUN_TLS_NAME not in names:
        raise ValueError(f"{directory / CERT_FILE} does not name {RUN_TLS_NAME} (subjectAltName DNS)")


def init_run_tls(directory: str | Path) -> None:
    """Write a new run CA and the run's certificate and key to directory; refuses to replace existing files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    existing = [name for name in (CA_FILE, CERT_FILE, KEY_FILE) if (directory / name).exists()]
    if existing:
        raise ValueError(f"{directory} already holds {', '.join(existing)}: a run's TLS files are never replaced")
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{RUN_TLS_NAME} CA")])
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, RUN_TLS_NAME)]), ca_name, key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(RUN_TLS_NAME)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    # Created with its final mode: the key must never be readable by others, not even for a moment.
    fd = os.open(directory / KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem)
    (directory / CERT_FILE).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / CA_FILE).write_bytes(ca.public_bytes(serialization.Encoding.PEM))


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, now: datetime.datetime
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
    )


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign, key_cert_sign=cert_sign, crl_sign=cert_sign, content_commitment=False,
        key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False, decipher_only=False,
    )


# The first byte of a TLS record that answers a ClientHello: a handshake message (ServerHello) or an alert.
_TLS_REPLY_TYPES = (0x16, 0x15)


def tls_mismatch(address: str, files: TlsFiles | None, timeout_s: float = 3.0) -> str | None:
    """What keeps this process's TLS settings (`files`, None: plaintext) from talking to the server at host:port, or
    None when nothing does (or it cannot be reached). gRPC reports all of these as the server being unavailable."""
    speaks = speaks_tls(address, timeout_s)
    if speaks is None or (speaks == (files is not None) and not speaks):
        return None
    if files is None:
        return f"{address} speaks TLS: pass the run's --tls-dir"
    if not speaks:
        return f"{address} does not speak TLS: leave out --tls-dir"
    if not _signed_by_run_ca(address, files, timeout_s):
        return f"{address} presents a certificate the run's CA did not sign: another run's --tls-dir?"
    return None


def _signed_by_run_ca(address: str, files: TlsFiles, timeout_s: float) -> bool:
    """Whether the TLS server at host:port presents a certificate for RUN_TLS_NAME signed by the run's CA (True
    when it cannot be told: only a failed check of the server's certificate says no)."""
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context(cadata=files.ca.decode())
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
            with context.wrap_socket(sock, server_hostname=RUN_TLS_NAME):
                return True
    except ssl.SSLCertVerificationError:
        return False
    except (OSError, ValueError):
        return True


def speaks_tls(address: str, timeout_s: float = 3.0) -> bool | None:
    """Whether the server at host:port answers a TLS ClientHello with TLS; None when it cannot be reached."""
    host, _, port = address.rpartition(":")
    hello = ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(ssl.MemoryBIO(), hello, server_hostname=RUN_TLS_NAME)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass  # the ClientHello is in `hello`, waiting for an answer this probe reads itself
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
            sock.sendall(hello.read())
            reply = sock.recv(3)
    except (OSError, ValueError):
        return None
    # A TLS record starts with its type and version 3.x; a plaintext HTTP/2 server answers with a frame instead.
    return len(reply) >= 2 and reply[0] in _TLS_REPLY_TYPES and reply[1] == 3
