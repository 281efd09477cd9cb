"""Renewing a joined Worker's short-lived certificate before it expires (R-ADM-2).

A Worker that joined (`qinglong-worker join`) holds a certificate of a few days. Once two
thirds of its lifetime have passed, the daemon makes a new key, asks for a successor over
its present mutual-TLS channel (WorkerService.RenewCertificate), and switches to it:

1. the new key and certificate are written under new names (``worker-<n>.key`` 0600, then
   ``worker-<n>.crt``), never over the files in use;
2. the client opens a channel with the new identity; calls in flight on the old channel
   finish. Executions never depend on the channel, so no work is dropped;
3. only then is ``worker.json`` replaced in one rename to name them: a crash at any point
   leaves either the old identity or the new one, never a key with another key's
   certificate — and a switch that failed leaves ``worker.json`` on the old certificate,
   so the next check renews again instead of believing the renewal done.

One check per minute in the daemon (not a timer per run); a failed renewal is retried at
the next check, and the old certificate keeps working until it expires.

A daemon killed (``kill -9``, a power cut) between steps 1 and 3 leaves a new key and
certificate that ``worker.json`` never named (or half of one, in its temporary file); one
killed after step 3 leaves the superseded key. So the renewal loop starts by finishing or
clearing what a crash left:

* a complete newer generation — its certificate and key belong together, and it is valid
  longer than the one named — is the renewal that was cut short: step 3 is done now and
  the client switched to it (`adopt_interrupted`), rather than making the Worker join
  again if the named certificate expired while it was down;
* then every Worker key and certificate in the directory that ``worker.json`` does not
  name is removed (`sweep_unnamed`): none is of use to anyone.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong_protocol.files import written_for
from qinglong_protocol.tls import TlsFiles

from qinglong_worker.join import (
    CERTIFICATE_FILE,
    KEY_FILE,
    new_private_key,
    private_key_pem,
    signing_request,
    trust_bundle,
    write_private,
    write_public,
)

log = logging.getLogger(__name__)

#: Renew once this much of the lifetime has passed (issue 9: two thirds).
RENEW_AT_FRACTION: Final = 2 / 3


class RenewingClient(Protocol):
    async def renew_certificate(
        self, request: ws.RenewCertificateRequest, *, budget_seconds: float | None = None
    ) -> ws.RenewCertificateResponse: ...

    async def use_identity(self, tls: TlsFiles, grace_seconds: float = 30.0) -> None: ...


def renewal_due(certificate_pem: bytes, now: dt.datetime) -> bool:
    certificate = x509.load_pem_x509_certificate(certificate_pem)
    start, end = certificate.not_valid_before_utc, certificate.not_valid_after_utc
    return now >= start + (end - start) * RENEW_AT_FRACTION


@dataclass
class CertificateRenewer:
    client: RenewingClient
    identity_file: Path
    worker_id: str
    clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)

    def _identity_if_due(self) -> dict[str, str] | None:
        identity: dict[str, str] = json.loads(self.identity_file.read_text())
        due = renewal_due(Path(identity["tls_cert"]).read_bytes(), self.clock())
        return identity if due else None

    def _named_key(self) -> Path:
        """The key worker.json names now."""
        return Path(json.loads(self.identity_file.read_text())["tls_key"])

    def _new_paths(self) -> tuple[Path, Path]:
        """The next generation's key and certificate file names, absolute: worker.json
        must name files a Worker started from any directory finds (a relative
        ``--identity`` would otherwise make them relative to where this one started)."""
        directory = self.identity_file.parent.resolve()
        generation = _next_generation(directory)
        name = f"{_GENERATION_PREFIX}{generation}"
        return directory / f"{name}{_KEY_SUFFIX}", directory / f"{name}{_CERTIFICATE_SUFFIX}"

    def _store(
        self,
        identity: dict[str, str],
        key: Any,
        answer: ws.RenewCertificateResponse,
        key_path: Path,
        cert_path: Path,
    ) -> TlsFiles:
        """Step 1: the new files under new names; returns them, and the identity that
        names them (written by step 3)."""
        write_private(key_path, private_key_pem(key))
        write_public(cert_path, answer.certificate_pem)
        # Control's roots beside those the Worker trusts already (it reached ingress with
        # them): a new root arrives before ingress's certificate moves to it.
        ca_file = Path(identity["tls_ca"])
        write_public(ca_file, trust_bundle(ca_file.read_text(), answer.ca_certificates_pem))
        identity.update(
            tls_key=str(key_path),
            tls_cert=str(cert_path),
            expire_time=answer.expire_time.ToJsonString(),
        )
        return TlsFiles(ca_cert=Path(identity["tls_ca"]), cert=cert_path, key=key_path)

    async def renew_if_due(self) -> bool:
        """Renew when due; True if the Worker now uses a new certificate."""
        identity = self._identity_if_due()
        if identity is None:
            return False
        superseded = (Path(identity["tls_key"]), Path(identity["tls_cert"]))
        key = new_private_key()
        answer = await self.client.renew_certificate(
            ws.RenewCertificateRequest(
                worker_id=self.worker_id, certificate_signing_request_pem=signing_request(key)
            )
        )
        key_path, cert_path = self._new_paths()
        try:
            renewed = self._store(identity, key, answer, key_path, cert_path)  # step 1
            await self.client.use_identity(renewed)  # step 2
            write_public(self.identity_file, json.dumps(identity, indent=2) + "\n")  # step 3
        except BaseException:
            # worker.json was not rewritten (a write failed, the switch failed, or the
            # daemon is stopping — perhaps while the old channel drains, the new one in
            # use: it holds its key in memory). The next check, or the next start, uses
            # the identity worker.json names and makes another key if it must; a private
            # key nothing names is of no use to anyone, so it does not stay on disk.
            if self._named_key() != key_path:
                _remove((key_path, cert_path))
            else:  # renamed into place, then a later step failed: the old key is done with
                _remove(superseded)
            raise
        _remove(superseded)  # the superseded key is of no use to anyone any more
        log.info("certificate renewed; valid until %s", identity["expire_time"])
        return True

    def sweep_unnamed(self) -> list[Path]:
        """Removes the Worker keys and certificates (as `join` and renewal name them) that
        ``worker.json`` does not name: what a crash in the middle of a renewal left.
        Returns what it removed. Runs before any renewal of this daemon, never during one."""
        identity: dict[str, str] = json.loads(self.identity_file.read_text())
        # Compared as the files they are: --identity may be relative while worker.json
        # names absolute paths (join writes them so), or the other way round. The
        # directory is the one renewal writes to (`_new_paths`).
        named = {Path(identity["tls_key"]).resolve(), Path(identity["tls_cert"]).resolve()}
        unnamed = [
            path
            for path in self.identity_file.parent.iterdir()
            if _is_worker_credential(path.name) and path.resolve() not in named
        ]
        _remove(tuple(unnamed))
        return unnamed

    def adopt_interrupted(self) -> TlsFiles | None:
        """Step 3 of a renewal a crash cut short: the newest generation newer than the
        one ``worker.json`` names, when its certificate and key belong together and it is
        valid longer than the named one, is named now. Returns its files (the client is
        still to switch to them), or None when there is nothing to finish."""
        identity: dict[str, str] = json.loads(self.identity_file.read_text())
        named_cert = _certificate(Path(identity["tls_cert"]))
        named_generation = _generation_of(Path(identity["tls_key"]).name) or 0
        directory = self.identity_file.parent
        generations = sorted(
            {n for path in directory.iterdir() if (n := _generation_of(path.name)) is not None},
            reverse=True,
        )
        for generation in (n for n in generations if n > named_generation):
            name = f"{_GENERATION_PREFIX}{generation}"
            key_path = directory / f"{name}{_KEY_SUFFIX}"
            cert_path = directory / f"{name}{_CERTIFICATE_SUFFIX}"
            certificate = _certificate(cert_path)
            if certificate is None or not _belong_together(certificate, key_path):
                continue  # half written: the sweep removes it
            now, end = self.clock(), certificate.not_valid_after_utc
            if end <= now or (named_cert is not None and end <= named_cert.not_valid_after_utc):
                continue
            identity.update(
                tls_key=str(key_path.resolve()),
                tls_cert=str(cert_path.resolve()),
                expire_time=end.isoformat().replace("+00:00", "Z"),
            )
            write_public(self.identity_file, json.dumps(identity, indent=2) + "\n")
            return TlsFiles(ca_cert=Path(identity["tls_ca"]), cert=cert_path, key=key_path)
        return None

    async def _finish_what_a_crash_left(self) -> None:
        try:
            adopted = self.adopt_interrupted()
            if adopted is not None:
                log.info("finished an interrupted renewal: now using %s", adopted.cert.name)
                await self.client.use_identity(adopted)
            removed = self.sweep_unnamed()
        except (OSError, ValueError, KeyError) as error:
            log.warning("could not tidy the identity's key files (%s)", type(error).__name__)
            return
        if removed:
            # File names only: where the stale files were, never their contents.
            log.info("removed stale key files: %s", ", ".join(p.name for p in removed))

    async def run(self, stop: asyncio.Event, check_seconds: float) -> None:
        await self._finish_what_a_crash_left()
        while not stop.is_set():
            try:
                await self.renew_if_due()
            except Exception as error:
                # The present certificate still works; only the error's type is logged (a
                # CSR, a key or a token is no business of a log line).
                log.warning("certificate renewal failed (%s); retrying later", type(error).__name__)
            try:
                await asyncio.wait_for(stop.wait(), check_seconds)
            except TimeoutError:
                continue


def _remove(paths: tuple[Path, ...]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


#: A renewed generation's files: ``worker-<n>.key`` and ``worker-<n>.crt``.
_GENERATION_PREFIX: Final = "worker-"
_KEY_SUFFIX: Final = Path(KEY_FILE).suffix
_CERTIFICATE_SUFFIX: Final = Path(CERTIFICATE_FILE).suffix


def _generation_of(name: str) -> int | None:
    """n for ``worker-<n>.key`` or ``worker-<n>.crt``; None for any other name."""
    path = Path(name)
    number = path.stem.removeprefix(_GENERATION_PREFIX)
    if (
        path.suffix not in (_KEY_SUFFIX, _CERTIFICATE_SUFFIX)
        or number == path.stem
        or not number.isdecimal()
    ):
        return None
    return int(number)


def _certificate(path: Path) -> x509.Certificate | None:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return None


def _belong_together(certificate: x509.Certificate, key_path: Path) -> bool:
    """Whether the certificate certifies the private key in ``key_path``."""
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return False
    return certificate.public_key() == key.public_key()


def _is_worker_credential(name: str) -> bool:
    """``worker.key``/``worker.crt`` (as joined), a renewed generation's, or the temporary
    file one of them was being written to."""
    name = written_for(name) or name
    return name in (KEY_FILE, CERTIFICATE_FILE) or _generation_of(name) is not None


def _next_generation(directory: Path) -> int:
    taken = (_generation_of(path.name) for path in directory.iterdir())
    return max((n for n in taken if n is not None), default=0) + 1


__all__ = ["CertificateRenewer", "renewal_due"]
