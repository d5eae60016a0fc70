"""TLS 1.3 for the direct data path: per-peer self-signed certificates, pinned through libp2p.

Why: the direct path moves all-reduce data and state downloads over TCP connections between
peers, outside the libp2p daemon, so it needs its own encryption and authentication. It uses
Python's ``ssl`` module (OpenSSL, TLS 1.3 only) on the event loop's transports; nothing here is
home-made cryptography. What is this project's own is only how the certificates are trusted:

- every :class:`~hivemind_ext.p2p.server.RPCServer` and :class:`~hivemind_ext.p2p.client.RPCClient`
  that uses the direct path holds a :class:`DirectIdentity`: a fresh ECDSA P-256 key and a
  self-signed certificate for it, made when the component starts and never written to disk;
- the certificates travel over the ticket call, a libp2p stream that the daemons already
  authenticate (noise) with the peers' libp2p keys: the caller sends its certificate with the
  ticket request, the server answers with its own. So each side learns which certificate the
  other's libp2p identity vouches for;
- each side then accepts exactly that certificate and nothing else (mutual authentication, pinned):
  the caller trusts only the server's certificate (:func:`client_context`), and the server trusts
  only the certificate its ticket was issued for (:class:`ServerContexts`; the caller names it by
  SNI, a non-secret digest prefix, see :func:`sni_name`), and checks after the handshake that the
  token presented inside the connection was issued for that certificate.

A certificate is trusted because the libp2p identity sent it, not because of its names or dates,
so names are fixed and the validity period is wide (clock skew between volunteers does not matter).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import hashlib
import os
import ssl
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from hivemind_ext.errors import AuthenticationError, ProtocolError

MAX_CERT_BYTES = 4096  # a P-256 self-signed certificate is about 400 bytes; anything far larger is refused
SNI_HEX_DIGITS = 32  # 128 bits of the certificate's SHA-256, one DNS label (at most 63 characters)
VALIDITY = datetime.timedelta(days=3650)
CLOCK_SKEW = datetime.timedelta(days=2)


@dataclass(frozen=True)
class DirectIdentity:
    """One side's TLS key and self-signed certificate (DER), in memory only."""

    cert_der: bytes
    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def generate(cls) -> DirectIdentity:
        """A fresh ECDSA P-256 key and a self-signed certificate for it (about a millisecond)."""
        # imported here: ``import hivemind_ext`` loads nothing beyond torch and hivemind (tests/test_startup.py)
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hivemind_ext direct path")])
        moment = datetime.datetime.now(datetime.timezone.utc)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(moment - CLOCK_SKEW)
            .not_valid_after(moment + VALIDITY)
            # a self-signed certificate that the other side loads as its only trust anchor
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        return cls(
            cert_der=certificate.public_bytes(serialization.Encoding.DER),
            cert_pem=certificate.public_bytes(serialization.Encoding.PEM),
            key_pem=key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
        )

    @property
    def fingerprint(self) -> bytes:
        return fingerprint(self.cert_der)


def fingerprint(cert_der: bytes) -> bytes:
    """The SHA-256 of a certificate's DER encoding: what the two sides pin."""
    return hashlib.sha256(cert_der).digest()


def sni_name(cert_der: bytes) -> str:
    """The server name a caller sends in its TLS hello: which of the server's expected callers'
    certificates to require. Not secret (a prefix of the certificate's digest)."""
    return "h" + fingerprint(cert_der).hex()[: SNI_HEX_DIGITS - 1]


def check_certificate(cert_der: object) -> bytes:
    """``cert_der`` if it is a DER certificate of bounded size that OpenSSL can load; else ProtocolError."""
    if not isinstance(cert_der, bytes) or not 0 < len(cert_der) <= MAX_CERT_BYTES:
        raise ProtocolError(f"a direct-path certificate must be 1..{MAX_CERT_BYTES} bytes of DER")
    from cryptography import x509  # see DirectIdentity.generate

    try:
        x509.load_der_x509_certificate(cert_der)
    except ValueError:
        raise ProtocolError("the direct-path certificate is not a valid X.509 certificate") from None
    return cert_der


def _context(purpose: ssl._SSLMethod, identity: DirectIdentity, trusted_der: bytes | None) -> ssl.SSLContext:
    context = ssl.SSLContext(purpose)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # the peer is identified by its pinned certificate, not by a name
    context.verify_mode = ssl.CERT_REQUIRED
    with _pem_file(identity.cert_pem + identity.key_pem) as path:
        context.load_cert_chain(path)
    if trusted_der is not None:
        try:
            context.load_verify_locations(cadata=trusted_der)
        except ssl.SSLError as e:
            raise ProtocolError(f"the peer's direct-path certificate cannot be used: {e}") from None
    return context


@contextlib.contextmanager
def _pem_file(data: bytes) -> Iterator[str]:
    """A path from which OpenSSL reads ``data`` (``load_cert_chain`` takes only paths): an in-memory
    file on Linux, so the private key never reaches a disk; elsewhere a private temporary file."""
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create("hivemind_ext-direct-key", os.MFD_CLOEXEC)
        try:
            os.write(fd, data)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.NamedTemporaryFile("wb", suffix=".pem") as file:  # created with mode 0600
        file.write(data)
        file.flush()
        yield file.name


def client_context(identity: DirectIdentity, server_cert_der: bytes) -> ssl.SSLContext:
    """A caller's context that presents ``identity`` and accepts only the server's pinned certificate."""
    return _context(ssl.PROTOCOL_TLS_CLIENT, identity, server_cert_der)


def check_pinned(ssl_object: ssl.SSLObject | ssl.SSLSocket | None, expected: bytes) -> None:
    """After a handshake: the peer's certificate must be exactly the pinned one (AuthenticationError)."""
    presented = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if presented is None or fingerprint(presented) != expected:
        raise AuthenticationError("the direct connection's peer presented a certificate other than the pinned one")


class ServerContexts:
    """The server's TLS contexts: one per expected caller certificate, chosen by the caller's SNI.

    The listening context has no trust anchor, so a caller whose SNI names no certificate that a
    ticket was issued for fails the handshake (fail closed). Contexts are kept for the
    ``capacity`` most recently registered callers (each is a few kilobytes).
    """

    def __init__(self, identity: DirectIdentity, capacity: int) -> None:
        self.identity, self.capacity = identity, capacity
        self.listening = _context(ssl.PROTOCOL_TLS_SERVER, identity, None)
        self.listening.sni_callback = self._select
        self._by_name: collections.OrderedDict[str, ssl.SSLContext] = collections.OrderedDict()

    def expect(self, cert_der: bytes) -> None:
        """Accept handshakes from the holder of ``cert_der`` (a certificate a ticket was issued for)."""
        name = sni_name(cert_der)
        if name in self._by_name:
            self._by_name.move_to_end(name)
            return
        self._by_name[name] = _context(ssl.PROTOCOL_TLS_SERVER, self.identity, cert_der)
        while len(self._by_name) > self.capacity:
            self._by_name.popitem(last=False)

    def _select(self, connection: ssl.SSLObject | ssl.SSLSocket, name: str | None, _: ssl.SSLContext) -> int | None:
        context = self._by_name.get(name) if name is not None else None
        if context is None:
            return ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME
        connection.context = context
        return None
