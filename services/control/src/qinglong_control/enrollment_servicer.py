"""Worker certificates in RuntimeService: a joining machine's token and CSR, and a
Worker's renewal over its own mutual TLS (R-ADM-2).

Ingress forwards JoinWorker from its enrollment listener with an anonymous caller: it
cannot check a join token (it writes no identity and holds no CA). Here the CSR is checked
first (a token is never spent on a request that cannot be answered), then the token is
consumed as the admin role -- once, unexpired, for an active Worker -- and only after that
commit is a certificate signed for the Worker the token names. A wrong, used or expired
token is one answer, UNAUTHENTICATED, without saying which. A renewal needs no token:
the call comes over the Worker's present certificate, and the Worker must still be
enrolled and active; the successor names the same Worker and lives as long.

The certificate's name is this deployment's URI for the Worker, computed here from the
trust domain and the worker id, never taken from the database's `certificate_uri` alone:
the CA also signs the services' certificates, and a URI written into the table by other
means than CreateWorker (the admin role's credentials, a bug) must not make it sign, say,
ingress's service identity. A row whose URI disagrees is refused.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import grpc
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from qinglong.enrollment.v1 import enrollment_service_pb2
from qinglong.runtime.v1 import caller_pb2, runtime_service_pb2, runtime_service_pb2_grpc
from qinglong.worker.v1 import worker_service_pb2
from qinglong_protocol.identities import worker_uri

from qinglong_control import wire
from qinglong_control.db import enrollment
from qinglong_control.domain.administration import NewSecret
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.issuing import (
    IssuedCertificate,
    IssuingAuthority,
    WorkerKey,
    key_digest,
)

Context = grpc.aio.ServicerContext[Any, Any]
Pool = AsyncConnectionPool[AsyncConnection[Any]]
rt = runtime_service_pb2
_log = logging.getLogger(__name__)


class EnrollmentMethods(runtime_service_pb2_grpc.RuntimeServiceServicer):
    def __init__(
        self, admin_pool: Pool | None, issuing: IssuingAuthority | None, trust_domain: str
    ) -> None:
        self._enrollment_pool = admin_pool
        self._issuing = issuing
        self._trust_domain = trust_domain

    async def JoinWorker(self, request: rt.JoinWorkerRequest, context: Context) -> Any:
        if request.caller.principal_kind != caller_pb2.PRINCIPAL_KIND_ANONYMOUS:
            raise Refused(Reason.FIELD_INVALID, "only a joining machine joins")
        pool, issuing = self._configured()
        public = request.request
        audit_id = wire.audit_id_of(request.audit_id)
        key = issuing.requested_key(public.certificate_signing_request_pem)
        issuing.ensure_can_issue(dt.datetime.now(dt.UTC))  # before the token is spent
        digest = NewSecret(public.join_token).digest
        async with pool.connection() as conn:
            enrolled = await enrollment.consume_join_token(conn, digest, key_digest(key), audit_id)
        if enrolled is None:
            raise Refused(Reason.UNAUTHENTICATED_PRINCIPAL, "the join token is not valid")
        issued = self._issue(issuing, key, enrolled)
        return rt.JoinWorkerResponse(
            response=enrollment_service_pb2.JoinWorkerResponse(
                worker_id=enrolled.worker_id, **_certificate_fields(issuing, issued)
            )
        )

    async def RenewCertificate(self, request: rt.RenewCertificateRequest, context: Context) -> Any:
        public = request.request
        worker_id = wire.worker_of(request.caller, public.worker_id)
        pool, issuing = self._configured()
        key = issuing.requested_key(public.certificate_signing_request_pem)
        async with pool.connection() as conn:
            enrolled = await enrollment.active_worker(conn, worker_id)
        if enrolled is None:
            raise Refused(Reason.UNAUTHENTICATED_PRINCIPAL, "the Worker is not enrolled")
        issued = self._issue(issuing, key, enrolled)
        return rt.RenewCertificateResponse(
            response=worker_service_pb2.RenewCertificateResponse(
                **_certificate_fields(issuing, issued)
            )
        )

    def _configured(self) -> tuple[Pool, IssuingAuthority]:
        if self._enrollment_pool is None or self._issuing is None:
            raise Refused(
                Reason.STORAGE_UNAVAILABLE,
                "Worker certificates are not configured on this control replica"
                " (needs --admin-database-url and the issuing CA)",
            )
        return self._enrollment_pool, self._issuing

    def _issue(
        self, issuing: IssuingAuthority, key: WorkerKey, enrolled: enrollment.Enrollment
    ) -> IssuedCertificate:
        """A certificate naming this deployment's URI for the Worker, at DB time."""
        uri = worker_uri(self._trust_domain, enrolled.worker_id)
        if enrolled.certificate_uri != uri:
            _log.warning(
                "Worker %s is enrolled under another name than this deployment gives it;"
                " no certificate issued (was the trust domain changed?)",
                enrolled.worker_id,
            )
            raise Refused(Reason.UNAUTHENTICATED_PRINCIPAL, "the Worker is not enrolled")
        now = dt.datetime.fromtimestamp(enrolled.now_ms / 1000, dt.UTC)
        return issuing.issue_worker_certificate(key, enrolled.worker_id, uri, now)


def _certificate_fields(issuing: IssuingAuthority, issued: IssuedCertificate) -> dict[str, Any]:
    """What a join and a renewal answer alike: the certificate, the CA, the expiry."""
    return {
        "certificate_pem": issued.certificate_pem,
        "ca_certificates_pem": issuing.ca_certificates_pem,
        "expire_time": wire.timestamp(issued.not_after_ms),
    }
