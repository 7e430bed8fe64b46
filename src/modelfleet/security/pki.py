"""The fleet's own certificate authority, and TLS for its listeners and clients.

Every listener another machine reaches speaks TLS. As k3s and Consul do, the control plane
makes a CA of its own in its state dir at its first start and issues the certificates the
fleet's listeners need; every client is given the CA's certificate (or pins it by its
fingerprint, as a join token carries it) and verifies the server against it. All the
cryptography is the `cryptography` package's: an ECDSA P-256 key per certificate, SHA-256
signatures, X.509 v3 with the names a server is reached by (DNS names and IP addresses) as
subject alternative names.

A node's certificate (signed at its join) names the node, not just where it is: a DNS name
of its own under `node.modelfleet.invalid` and a SPIFFE-style URI, besides the one address
the control plane lets it have. Clients of a node check its name (`node_host`), so a node's
certificate can pass for no other node, nor for a control plane or a router.

The CA's fingerprint is the SHA-256 of its public key (the DER SubjectPublicKeyInfo), written
`sha256:<hex>`, as kubeadm's discovery hash is: it stays the same if the CA's certificate is
ever issued again with the same key.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import re
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
_CA_YEARS = 10
_LEEWAY = datetime.timedelta(minutes=5)  # clocks of the fleet's machines differ a little
MAX_NAMES = 16  # hosts one certificate may name
NODE_DOMAIN = "node.modelfleet.invalid"
# What a router's client certificate names it by, and all an engine's gate lets in: no other
# certificate of the CA names it (a node's is signed for its own name, whatever it asks for).
ROUTER_URI = "spiffe://modelfleet/router"
_PLAIN_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


class PkiError(Exception):
    """A certificate, key or fingerprint that cannot be used; the message says which and
    what to do."""


@dataclass(frozen=True)
class TlsFiles:
    """A listener's certificate chain and private key, as PEM files."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key, PEM-encoded."""

    cert_pem: bytes
    key_pem: bytes

    def write(self, folder: Path, stem: str) -> TlsFiles:
        """Write `stem.crt` and `stem.key` into `folder` (made 0700 if missing), both 0600 like
        everything in a state dir (a certificate is no secret; copy it where it is needed)."""
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        files = TlsFiles(folder / f"{stem}.crt", folder / f"{stem}.key")
        _write_private(files.key, self.key_pem)
        _write_private(files.cert, self.cert_pem)
        return files


class CertificateAuthority:
    """A CA: its certificate, and its key, which signs the fleet's certificates."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.cert = cert
        self._key = key

    @classmethod
    def create(cls, name: str, now: datetime.datetime) -> CertificateAuthority:
        """A new CA named `name`, valid for ten years from `now`."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _LEEWAY)
            .not_valid_after(now + datetime.timedelta(days=365 * _CA_YEARS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @classmethod
    def load_or_create(
        cls, folder: Path, name: str, now: datetime.datetime
    ) -> CertificateAuthority:
        """The CA kept in `folder` (`ca.crt`, `ca.key`), made there first if it has none.
        A folder with one of the two files and not the other is refused: a CA made anew
        would cut off every machine that trusts the old one."""
        cert_file, key_file = folder / CA_CERT, folder / CA_KEY
        if cert_file.exists() != key_file.exists():
            have, lack = (cert_file, key_file) if cert_file.exists() else (key_file, cert_file)
            raise PkiError(
                f"{have} is there but {lack} is not: restore it from a backup; making a new CA "
                "would cut off every machine that trusts this one"
            )
        if cert_file.exists():
            return cls.load(cert_file, key_file)
        ca = cls.create(name, now)
        ca.write(folder)
        return ca

    @classmethod
    def load(cls, cert_file: Path, key_file: Path) -> CertificateAuthority:
        try:
            return cls.from_pem(cert_file.read_bytes(), key_file.read_bytes())
        except OSError as exc:
            raise PkiError(f"cannot read the CA from {cert_file} and {key_file}: {exc}") from exc
        except PkiError as exc:
            raise PkiError(f"{cert_file}, {key_file}: {exc}") from exc

    @classmethod
    def from_pem(cls, cert_pem: bytes, key_pem: bytes) -> CertificateAuthority:
        """The CA of a certificate and its EC private key, as PEM. Raises PkiError."""
        try:
            cert = x509.load_pem_x509_certificate(cert_pem)
            key = serialization.load_pem_private_key(key_pem, password=None)
        except ValueError as exc:
            raise PkiError(f"not a CA certificate and key: {exc}") from exc
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise PkiError("the CA's key is no EC private key")
        return cls(cert, key)

    def write(self, folder: Path) -> None:
        """Keep the CA in `folder` (`ca.crt`, `ca.key`), replacing what is there."""
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write_private(folder / CA_KEY, self.key_pem)
        _write_private(folder / CA_CERT, self.cert_pem)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return _key_pem(self._key)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert)

    def issue(
        self, names: list[str], now: datetime.datetime, days: int = 365, client: bool = False
    ) -> Issued:
        """A certificate for a server reached by `names` (DNS names or IP addresses), valid
        `days` from `now`; `client`: for a client to present instead."""
        if not names:
            raise PkiError("a certificate needs at least one name to be reached by")
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
        alt = x509.SubjectAlternativeName([_general_name(n) for n in names])
        cert = self._builder(subject, key.public_key(), now, days, alt, client)
        signed = cert.sign(self._key, hashes.SHA256())
        return Issued(signed.public_bytes(serialization.Encoding.PEM), _key_pem(key))

    def _builder(
        self,
        subject: x509.Name,
        key: ec.EllipticCurvePublicKey,
        now: datetime.datetime,
        days: int,
        names: x509.SubjectAlternativeName,
        client: bool,
    ) -> x509.CertificateBuilder:
        """A leaf certificate of this CA, for `key` and `names`, not yet signed."""
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.cert.subject)
            .public_key(key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _LEEWAY)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(names, False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), False
            )
        )

    def issue_router_client(self, now: datetime.datetime, days: int = 365) -> Issued:
        """The certificate routers present to engines' gates (`ROUTER_URI`, for a client)."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "modelfleet router")])
        alt = x509.SubjectAlternativeName([x509.UniformResourceIdentifier(ROUTER_URI)])
        cert = self._builder(subject, key.public_key(), now, days, alt, client=True)
        signed = cert.sign(self._key, hashes.SHA256())
        return Issued(signed.public_bytes(serialization.Encoding.PEM), _key_pem(key))

    def sign_node(
        self,
        request: CertificateRequest,
        node: str,
        addresses: Sequence[str],
        now: datetime.datetime,
        days: int = 365,
    ) -> bytes:
        """The certificate (PEM) of node `node`'s listeners, for the key of `request`: it
        names the node (`node_host`, `node_uri`) and `addresses`, nothing else, whatever the
        request asked for (the caller decides which addresses the node may serve on)."""
        names: list[x509.GeneralName] = [
            x509.DNSName(node_host(node)),
            x509.UniformResourceIdentifier(node_uri(node)),
            *(x509.IPAddress(ipaddress.ip_address(a)) for a in addresses),
        ]
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_host(node))])
        cert = self._builder(
            subject, request.key, now, days, x509.SubjectAlternativeName(names), False
        )
        return cert.sign(self._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class CertificateRequest:
    """A certificate signing request, read and checked: its key, and the names it asks for
    (DNS names and IP addresses, as text)."""

    key: ec.EllipticCurvePublicKey
    names: tuple[str, ...]


def read_request(csr_pem: bytes) -> CertificateRequest:
    """The request in `csr_pem`. PkiError if it is unreadable, not signed by its own key, not
    for an EC key, or names nothing (or more than MAX_NAMES, or something neither a DNS name
    nor an IP address)."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as exc:
        raise PkiError(f"the certificate request is unreadable: {exc}") from exc
    if not csr.is_signature_valid:
        raise PkiError("the certificate request is not signed by the key it names")
    try:
        alt = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise PkiError("the certificate request names no host to be reached by") from None
    if not 0 < len(alt) <= MAX_NAMES:
        raise PkiError(f"a certificate request may name 1 to {MAX_NAMES} hosts")
    names = []
    for name in alt:
        if not isinstance(name, (x509.DNSName, x509.IPAddress)):
            raise PkiError(f"the certificate request names {name}: only hosts and addresses")
        names.append(str(name.value))
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise PkiError("the certificate request's key is not an EC key")
    return CertificateRequest(key, tuple(names))


def node_host(node: str) -> str:
    """The DNS name a node's certificate names it by, under NODE_DOMAIN, which never resolves
    (RFC 2606 reserves `.invalid`). A client that reaches a node's listener, at whatever
    address, checks the certificate against this name: it says which node answers, which an
    address cannot (a node may move, and a certificate for an address could be another's).
    A node name that is a plain lowercase DNS label is itself; any other is written as `x--`
    and the hex of its UTF-8 bytes (in labels of at most 60), so that names differing only in
    case never share one."""
    if _PLAIN_LABEL.fullmatch(node) and "--" not in node:
        return f"{node}.{NODE_DOMAIN}"
    hexed = node.encode().hex()
    labels = [hexed[i : i + 60] for i in range(0, len(hexed), 60)]
    return ".".join(["x--" + labels[0], *labels[1:], NODE_DOMAIN])


def node_uri(node: str) -> str:
    """The URI a node's certificate names it by, as SPIFFE's identities are written."""
    return f"spiffe://modelfleet/node/{node}"


def request(names: list[str]) -> tuple[bytes, bytes]:
    """A new private key and a certificate signing request for a server reached by `names`,
    both PEM: the key never leaves the machine that made it; the CA signs the request."""
    if not 0 < len(names) <= MAX_NAMES:
        raise PkiError(f"a certificate names 1 to {MAX_NAMES} hosts, not {len(names)}")
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]), False)
        .sign(key, hashes.SHA256())
    )
    return _key_pem(key), csr.public_bytes(serialization.Encoding.PEM)


def fingerprint(cert: x509.Certificate) -> str:
    """`sha256:<hex>` of the certificate's public key (its DER SubjectPublicKeyInfo)."""
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256:" + hashlib.sha256(spki).hexdigest()


def pinned_ca(cert_pem: bytes, expected: str) -> x509.Certificate:
    """The CA certificate in `cert_pem` if its fingerprint is `expected`; PkiError if not
    (someone between this machine and the control plane, or a token of another fleet)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise PkiError(f"the CA certificate offered is unreadable: {exc}") from exc
    got = fingerprint(cert)
    if got != expected.lower():
        raise PkiError(
            f"the CA offered has fingerprint {got}, not the {expected} the token pins: "
            "refusing it (a token of another fleet, or someone in between)"
        )
    return cert


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """The TLS context of a listener that presents `files` (TLS 1.2 at least)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(files.cert, files.key)
    except (OSError, ssl.SSLError) as exc:
        raise PkiError(f"cannot use {files.cert} with {files.key}: {exc}") from exc
    return context


def client_context(ca_pem: bytes) -> ssl.SSLContext:
    """A client's TLS context that trusts only the CA in `ca_pem` and checks that the
    server's certificate names the host it was reached by."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_verify_locations(cadata=ca_pem.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError) as exc:
        raise PkiError(f"the CA certificate given is unusable: {exc}") from exc
    return context


def client_context_with(ca_pem: bytes, identity: Issued) -> ssl.SSLContext:
    """`client_context(ca_pem)` that also presents `identity` (a client certificate). The
    ssl module loads a certificate only from files: they are written in a private temporary
    folder and removed once read."""
    context = client_context(ca_pem)
    with tempfile.TemporaryDirectory(prefix="modelfleet-tls-") as folder:
        files = identity.write(Path(folder), "client")
        try:
            context.load_cert_chain(files.cert, files.key)
        except ssl.SSLError as exc:
            raise PkiError(f"the client certificate given is unusable: {exc}") from exc
    return context


def gate_context(files: TlsFiles, ca: Path) -> ssl.SSLContext:
    """The TLS context of an engine's gate: it presents `files` and lets in only clients
    with a certificate of the CA in `ca` (which of those it serves, `is_router` says)."""
    context = server_context(files)
    context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise PkiError(f"cannot use {ca} as the CA of the gate's clients: {exc}") from exc
    return context


def is_router(peer: dict[str, object] | None) -> bool:
    """Whether a verified client certificate (as `SSLObject.getpeercert()` gives it) is a
    router's: it names ROUTER_URI."""
    if not peer:
        return False
    names = peer.get("subjectAltName", ())
    return isinstance(names, tuple) and ("URI", ROUTER_URI) in names


def is_loopback(host: str) -> bool:
    """Whether a listener on `host` is reached from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """Whether `host` binds every address of the machine (0.0.0.0, ::)."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host == ""


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """A private key as unencrypted PKCS#8 PEM: its file's mode is what protects it."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path`, readable by its owner only from its first byte on."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(path, 0o600)
