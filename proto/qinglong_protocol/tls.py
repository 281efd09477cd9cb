"""Mutual TLS for every QingLong gRPC hop: where the material lives, and who the peer is.

Every server requires a client certificate signed by the deployment's CA, and
every client verifies the server's certificate against the same CA. Identities
are SPIFFE-style SAN URIs (``spiffe://<trust-domain>/worker/<worker_id>``,
``.../service/ingress``, ``.../operator/<name>``); the helpers at the bottom read
them from a call's ``auth_context()`` so that servers decide from the verified
certificate, never from anything the caller writes into a request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

# Keys of grpc's auth context (grpcio 1.85, TSI/SSL transport). `peer_uri` holds
# every URI SAN of the verified peer certificate; `peer_spiffe_id` is set only
# when the certificate carries exactly one URI SAN that is a valid SPIFFE id.
AUTH_KEY_PEER_URI = "peer_uri"
AUTH_KEY_PEER_SPIFFE_ID = "peer_spiffe_id"
AUTH_KEY_TLS_VERSION = "ssl_tls_version"


@dataclass(frozen=True)
class TlsFiles:
    """Paths of one party's TLS material: the CA it trusts, its own certificate and key."""

    ca_cert: Path
    cert: Path
    key: Path


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes read from `TlsFiles`; kept in memory only to build credentials."""

    ca_cert: bytes
    cert: bytes
    key: bytes

    def __repr__(self) -> str:
        # The private key must never reach a log line or a traceback.
        return f"TlsMaterial(ca_cert=<{len(self.ca_cert)} bytes>, cert=<{len(self.cert)} bytes>)"


def read_tls_material(files: TlsFiles) -> TlsMaterial:
    """Read the three PEM files once, at start-up."""
    return TlsMaterial(
        ca_cert=files.ca_cert.read_bytes(),
        cert=files.cert.read_bytes(),
        key=files.key.read_bytes(),
    )


def mutual_tls_server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Server credentials that refuse any client without a certificate from our CA.

    A client without a certificate fails the handshake and sees UNAVAILABLE.
    """
    material = read_tls_material(files)
    return grpc.ssl_server_credentials(
        [(material.key, material.cert)],
        root_certificates=material.ca_cert,
        require_client_auth=True,
    )


def mutual_tls_channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Channel credentials that present our certificate and verify the server's against our CA."""
    material = read_tls_material(files)
    return grpc.ssl_channel_credentials(
        root_certificates=material.ca_cert,
        private_key=material.key,
        certificate_chain=material.cert,
    )


@dataclass(frozen=True)
class PeerTls:
    """What the TLS layer verified about the caller of one RPC."""

    uris: tuple[str, ...]
    spiffe_id: str | None
    tls_version: str | None


def _decoded(values: Iterable[bytes] | None) -> tuple[str, ...]:
    if values is None:
        return ()
    return tuple(value.decode("utf-8", errors="replace") for value in values)


def peer_tls(auth_context: Mapping[str, Iterable[bytes]]) -> PeerTls:
    """Read the verified peer identity from `context.auth_context()`.

    An insecure or certificate-less call yields an empty `uris` tuple, so callers
    that look for an allowed URI fail closed.
    """
    spiffe = _decoded(auth_context.get(AUTH_KEY_PEER_SPIFFE_ID))
    version = _decoded(auth_context.get(AUTH_KEY_TLS_VERSION))
    return PeerTls(
        uris=_decoded(auth_context.get(AUTH_KEY_PEER_URI)),
        spiffe_id=spiffe[0] if spiffe else None,
        tls_version=version[0] if version else None,
    )


def peer_uris(auth_context: Mapping[str, Iterable[bytes]]) -> tuple[str, ...]:
    """The SAN URIs of the caller's verified certificate (empty when there is none)."""
    return peer_tls(auth_context).uris
