"""Mutual TLS for every QingLong gRPC hop: where the material lives, and who the peer is.

Every server requires a client certificate signed by the deployment's CA, and
every client verifies the server's certificate against the same CA. Identities
are SPIFFE-style SAN URIs (``spiffe://<trust-domain>/worker/<worker_id>``,
``.../service/ingress``, ``.../operator/<name>``); the helpers at the bottom read
them from a call's ``auth_context()`` so that servers decide from the verified
certificate, never from anything the caller writes into a request.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

_log = logging.getLogger(__name__)

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
    """Read the three PEM files as they are now."""
    return TlsMaterial(
        ca_cert=files.ca_cert.read_bytes(),
        cert=files.cert.read_bytes(),
        key=files.key.read_bytes(),
    )


class TlsFilesWatch:
    """Whether one party's TLS files changed since they were last read.

    Certificates are short-lived and replaced in place while a service runs: cert-manager
    renews a Secret a third of a lifetime early and the kubelet swaps the mounted files
    (all at once: a new directory behind a symlink), or an operator writes new ones. A
    file's inode, modification time and size say it changed; nothing is read to find out.
    """

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._read: object = None

    def signature(self) -> object:
        """The files' inodes, modification times and sizes now (None if one is missing)."""
        return self._signature()

    def forget(self) -> None:
        """Count the files as changed until they are read again (what was read could not
        be used: the next look tries again)."""
        self._read = None

    def _signature(self) -> object:
        try:
            paths = (self.files.ca_cert, self.files.cert, self.files.key)
            stats = [os.stat(path) for path in paths]
        except OSError:
            return None  # in the middle of a swap, or gone: judged at the next look
        return tuple((stat.st_ino, stat.st_mtime_ns, stat.st_size) for stat in stats)

    def changed(self) -> bool:
        """The files are there, and not as they were when last read."""
        now = self._signature()
        return now is not None and now != self._read

    def read(self) -> TlsMaterial:
        """Read the files (what a later change is measured against)."""
        signature = self._signature()  # before reading: a change meanwhile shows next time
        material = read_tls_material(self.files)
        self._read = signature
        return material


def mutual_tls_server_credentials(
    files: TlsFiles, *, require_client_auth: bool = True
) -> grpc.ServerCredentials:
    """Server credentials that refuse any client without a certificate from our CA (with
    ``require_client_auth``; without, a server-authenticated listener such as Worker
    enrollment), and that take up renewed files without a restart: each new connection's
    handshake first looks whether the files changed (:class:`TlsFilesWatch`) and, if so,
    reads them. Connections already open keep their session.

    A client without a certificate fails the handshake and sees UNAVAILABLE.
    """
    watch = TlsFilesWatch(files)
    # The fetcher runs on grpc's threads, a handshake each: one look at a time.
    lock = threading.Lock()
    unreadable: list[object] = [None]  # the signature last found unreadable: warned once

    def configuration(material: TlsMaterial) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(material.key, material.cert)],
            root_certificates=material.ca_cert if require_client_auth else None,
        )

    def renewed() -> grpc.ServerCertificateConfiguration | None:
        # Called by grpc at each handshake: nothing may be raised into it. A key that does
        # not match its certificate (files written one by one) grpc refuses itself,
        # keeping the configuration it has; the next change is taken up.
        with lock:
            try:
                if not watch.changed():
                    return None
                updated = configuration(watch.read())
            except Exception as error:  # an unreadable file mid-rotation: the next look
                if watch.signature() != unreadable[0]:
                    unreadable[0] = watch.signature()
                    _log.warning("TLS files of %s not read: %s", files.cert, error)
                return None
        _log.info("TLS files of %s changed: new connections use them", files.cert)
        return updated

    return grpc.dynamic_ssl_server_credentials(
        configuration(watch.read()),
        renewed,  # type: ignore[arg-type]  # grpc takes None for "no change"; its stub not
        require_client_authentication=require_client_auth,
    )


def mutual_tls_channel_credentials(
    files: TlsFiles, material: TlsMaterial | None = None
) -> grpc.ChannelCredentials:
    """Channel credentials that present our certificate and verify the server's against our
    CA (``material`` already read from ``files``, or read now)."""
    material = read_tls_material(files) if material is None else material
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
