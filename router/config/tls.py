"""The listeners' TLS files: read, checked, and made into what each server needs.

One module reads ``[server.http_tls]`` and ``[server.grpc_tls]``'s files, for
three users: the config check (a missing file, a certificate and key that
do not belong together or an unreadable CA refuse the config, naming the
key), the HTTP server (an ``ssl.SSLContext``) and the gRPC front end (the
PEM bytes grpc takes). Each use reads the files again, so a reload after a
certificate was rotated serves the new one. Only stdlib ``ssl`` here; the
gRPC side turns the bytes into grpc's credentials itself.
"""

from __future__ import annotations

import hashlib
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field

from .types import TlsConfig

_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
_PRIVATE_KEY = b"PRIVATE KEY-----"


class TlsFileError(Exception):
    """A TLS file that cannot serve; ``key`` is its key in the table (``cert_file``, ...)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


@dataclass(frozen=True)
class TlsPem:
    """The files' bytes, as grpc takes them (the key is never shown)."""

    cert_chain: bytes
    private_key: bytes = field(repr=False)
    client_ca: bytes | None

    @property
    def fingerprint(self) -> str:
        """A short hash of all three: it changes when any file does."""
        digest = hashlib.sha256(self.cert_chain)
        digest.update(b"\0" + self.private_key + b"\0" + (self.client_ca or b""))
        return digest.hexdigest()[:16]


def read_pem(tls: TlsConfig) -> TlsPem:
    """The three files as they are now; :exc:`TlsFileError` if one cannot be read or is not PEM of its kind."""
    cert_chain = _read(tls.cert_file, "cert_file")
    private_key = _read(tls.key_file, "key_file")
    client_ca = None if tls.client_ca_file is None else _read(tls.client_ca_file, "client_ca_file")
    if _CERTIFICATE not in cert_chain:
        raise TlsFileError("cert_file", f"{tls.cert_file} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    if _PRIVATE_KEY not in private_key:
        raise TlsFileError("key_file", f"{tls.key_file} holds no PEM private key")
    if client_ca is not None and _CERTIFICATE not in client_ca:
        raise TlsFileError("client_ca_file", f"{tls.client_ca_file} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    return TlsPem(cert_chain, private_key, client_ca)


def checked(tls: TlsConfig) -> TlsConfig:
    """``tls`` with its fingerprint, once the files load as a server's would; else :exc:`TlsFileError`."""
    pem = read_pem(tls)
    server_context(tls)  # what OpenSSL says of the pair and the CA
    return TlsConfig(tls.cert_file, tls.key_file, tls.client_ca_file, fingerprint=pem.fingerprint)


def server_context(tls: TlsConfig, alpn: Sequence[str] = ("http/1.1",)) -> ssl.SSLContext:
    """A server's context from the files as they are now: TLS 1.2 or later, client certificates
    required when ``client_ca_file`` is set. Raises :exc:`TlsFileError` naming the key at fault."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(list(alpn))
    try:
        # A password callback, so an encrypted key fails here instead of prompting on the terminal.
        context.load_cert_chain(tls.cert_file, tls.key_file, password=_no_password)
    except OSError as error:  # ssl.SSLError is one too
        reason = getattr(error, "reason", None) or error.strerror or str(error)
        raise TlsFileError(
            "key_file", f"{tls.key_file} is not the unencrypted private key of {tls.cert_file}'s certificate ({reason})"
        ) from None
    if tls.client_ca_file is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        try:
            context.load_verify_locations(cafile=tls.client_ca_file)
        except OSError as error:
            reason = getattr(error, "reason", None) or error.strerror or str(error)
            raise TlsFileError("client_ca_file", f"{tls.client_ca_file} is not a usable CA certificate ({reason})") from None
    return context


def _no_password() -> bytes:
    return b""


def _read(path: str, key: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as error:
        raise TlsFileError(key, f"cannot read {path}: {error.strerror or error}") from None
