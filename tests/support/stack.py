"""An in-process stack for integration tests: control + ingress over real mTLS on
loopback, each with its own database role (control also the admin role, for
AdminService), and clients holding real certificates."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psycopg
from qinglong_cli.pki import (
    DevPki,
    ensure_dev_pki,
    ensure_operator_identity,
    ensure_worker_identity,
    operator_uri,
    service_uri,
    worker_uri,
)
from qinglong_control.db.identities import (
    bind_role,
    enroll_operator_certificate,
    enroll_operator_token,
    enroll_worker,
    ensure_project,
    grant_cluster_admin,
)
from qinglong_control.db.pool import open_admin_pool, open_runtime_pool
from qinglong_control.domain.timings import Timings
from qinglong_control.issuing import IssuingAuthority
from qinglong_control.server import create_server as create_control_server
from qinglong_control.servicer import RuntimeServicer
from qinglong_control.settings import ControlSettings
from qinglong_ingress.directory import Directory
from qinglong_ingress.gateway import Gateway
from qinglong_ingress.handlers import public_handlers
from qinglong_ingress.pool import open_ingress_pool
from qinglong_ingress.routes import ENROLLMENT_ROUTES
from qinglong_ingress.server import create_enrollment_server, open_control_channel
from qinglong_ingress.server import create_server as create_ingress_server
from qinglong_ingress.settings import ControlChannelSettings, IngressSettings
from qinglong_ingress.stages import Stage, admission_stages, enrollment_stages
from qinglong_protocol.pooling import PoolSizing, RecoveringPool
from qinglong_protocol.storage import StorageBounds
from qinglong_protocol.tls import TlsFiles, mutual_tls_channel_credentials

from tests.support.postgres import MigratedDatabase

PROJECT = "proj-a"


class CallCounter(grpc.aio.ServerInterceptor):
    """Records calls that reach control's runtime API (proof that a refusal was not
    forwarded) and the deadline each arrived with (proof that ingress passed it on)."""

    def __init__(self) -> None:
        self.methods: list[str] = []
        self.time_remaining: list[float | None] = []
        self.traceparents: list[str | None] = []
        self.tracestates: list[str | None] = []

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if not handler_call_details.method.startswith("/qinglong.runtime.v1."):
            return handler
        self.methods.append(handler_call_details.method.rsplit("/", 1)[-1])
        metadata = dict(handler_call_details.invocation_metadata or ())
        self.traceparents.append(metadata.get("traceparent"))  # type: ignore[arg-type]
        self.tracestates.append(metadata.get("tracestate"))  # type: ignore[arg-type]
        if handler is None or handler.unary_unary is None:
            return handler
        behaviour = handler.unary_unary

        async def recorded(request: Any, context: Any) -> Any:
            self.time_remaining.append(context.time_remaining())
            return await behaviour(request, context)

        return grpc.unary_unary_rpc_method_handler(
            recorded, handler.request_deserializer, handler.response_serializer
        )


@dataclass
class Stack:
    pki: DevPki
    database: MigratedDatabase
    ingress_address: str
    control_calls: CallCounter
    tokens: dict[str, str]
    control_server: grpc.aio.Server
    enrollment_address: str
    """The Worker enrollment listener: server-authenticated TLS, JoinWorker only."""
    ingress_pool: RecoveringPool
    """The worker-ingress role's pool (one connection when ``ingress_pool_size=1``)."""
    directory: Directory
    """Ingress's directory (its audit group commit's queue can be watched)."""
    control_address: str = ""
    """Control's listener (only ingress's identity may call its runtime API)."""

    def channel(self, identity: TlsFiles) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(
            self.ingress_address, mutual_tls_channel_credentials(identity)
        )

    def worker_identity(self, worker_id: str) -> TlsFiles:
        return ensure_worker_identity(self.pki, worker_id)

    def operator_identity(self, name: str) -> TlsFiles:
        return ensure_operator_identity(self.pki, name)

    def audit_rows(self) -> list[dict[str, Any]]:
        with psycopg.connect(self.database.urls.migration) as conn:
            cursor = conn.execute(
                "SELECT * FROM qinglong.security_audit ORDER BY occurred_at_ms, audit_id"
            )
            names = [c.name for c in cursor.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def bearer(stack: Stack, name: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the bearer token of the enrolled operator ``name``."""
    return (("authorization", f"Bearer {stack.tokens[name]}"),)


def enroll_people(database: MigratedDatabase, pki: DevPki) -> dict[str, str]:
    """Workers worker-a/b; operators alice (operator), vera (viewer), bot (agent, operator),
    mallory (no role), and root (a cluster admin, no project role), each with a bearer
    token; `carol` (operator) by certificate only. Returns the bearer tokens."""
    tokens = {
        name: "qlo1_" + secrets.token_urlsafe(32)
        for name in ("alice", "vera", "bot", "mallory", "root")
    }
    kinds = {"alice": "user", "vera": "user", "bot": "agent", "mallory": "user", "root": "user"}
    roles = {"alice": "operator", "vera": "viewer", "bot": "operator"}
    with psycopg.connect(database.urls.migration, autocommit=True) as conn:
        ensure_project(conn, PROJECT, PROJECT)
        for worker_id in ("worker-a", "worker-b"):
            enroll_worker(conn, worker_id, worker_uri(pki.trust_domain, worker_id))
        principal_ids = {}
        for name, token in tokens.items():
            digest = hashlib.sha256(token.encode()).hexdigest()
            principal = enroll_operator_token(conn, name, kinds[name], digest)  # type: ignore[arg-type]
            principal_ids[name] = principal
            if name in roles:
                bind_role(conn, PROJECT, principal, roles[name])  # type: ignore[arg-type]
        grant_cluster_admin(conn, principal_ids["root"])
        carol = enroll_operator_certificate(
            conn, "carol", "user", operator_uri(pki.trust_domain, "carol")
        )
        bind_role(conn, PROJECT, carol, "operator")
    return tokens


@asynccontextmanager
async def running_stack(
    database: MigratedDatabase,
    pki_dir: Path,
    extra_stages: tuple[Stage, ...] = (),
    *,
    ingress_pool_size: int = 4,
    ingress_storage: StorageBounds | None = None,
    control_pool_size: int = 4,
    control_storage: StorageBounds | None = None,
    timings: Timings | None = None,
    enrollment_per_peer_per_minute: float = 600,
    control_via: Callable[[str], str] | None = None,
) -> AsyncIterator[Stack]:
    """The stack; ``extra_stages`` run after ingress's own admission stages (a new rule);
    ``ingress_storage`` widens ingress's storage bound for a test that holds a lock
    (``control_storage`` control's, which answers each command within it). The
    enrollment limit is generous (tests join many times from one host) unless a test of
    the limit itself lowers it. ``control_via`` maps control's address to the one ingress
    dials (a relay in between)."""
    pki = ensure_dev_pki(pki_dir)
    tokens = enroll_people(database, pki)
    counter = CallCounter()
    runtime_pool = await open_runtime_pool(
        database.urls.runtime, sizing=PoolSizing(1, control_pool_size), bounds=control_storage
    )
    admin_pool = await open_admin_pool(database.urls.admin)
    ingress_pool = await open_ingress_pool(
        database.urls.ingress, sizing=PoolSizing(1, ingress_pool_size), bounds=ingress_storage
    )
    control, control_port = await create_control_server(
        ControlSettings(
            listen_address="127.0.0.1:0",
            tls=pki.control_server,
            allowed_caller_uris=frozenset({service_uri(pki.trust_domain, "ingress")}),
            storage=control_storage or StorageBounds(),
        ),
        runtime_servicer=RuntimeServicer(
            runtime_pool,
            timings or Timings(),
            admin_pool=admin_pool,
            trust_domain=pki.trust_domain,
            # The dev CA signs joining Workers' certificates, as in `qinglong up`.
            issuing=IssuingAuthority.load(pki.ca_cert, pki.ca_key),
        ),
        interceptors=[counter],
    )
    await control.start()
    settings = IngressSettings(
        listen_address="127.0.0.1:0",
        tls=pki.ingress_server,
        control=ControlChannelSettings(
            (control_via or str)(f"127.0.0.1:{control_port}"), pki.ingress_client
        ),
        trust_domain=pki.trust_domain,
    )
    channel = open_control_channel(settings.control)
    # As in the service: an audit batch waits at most the statement bound.
    directory = Directory(
        ingress_pool, (ingress_storage or StorageBounds()).statement_timeout_ms / 1000
    )
    stages = (*admission_stages(directory, pki.trust_domain), *extra_stages)
    gateway = Gateway(directory, channel, pki.trust_domain, storage=ingress_storage, stages=stages)
    ingress, ingress_port = await create_ingress_server(settings, public_handlers(gateway))
    await ingress.start()
    limits = enrollment_stages(enrollment_per_peer_per_minute, 600)
    joining = Gateway(directory, channel, pki.trust_domain, stages=limits)
    enrollment, enrollment_port = await create_enrollment_server(
        "127.0.0.1:0", pki.ingress_server, public_handlers(joining, ENROLLMENT_ROUTES)
    )
    await enrollment.start()
    try:
        yield Stack(
            pki,
            database,
            f"127.0.0.1:{ingress_port}",
            counter,
            tokens,
            control,
            f"127.0.0.1:{enrollment_port}",
            ingress_pool,
            directory,
            f"127.0.0.1:{control_port}",
        )
    finally:
        await enrollment.stop(None)
        await ingress.stop(None)
        await channel.close()
        await control.stop(None)
        await ingress_pool.close()
        await admin_pool.close()
        await runtime_pool.close()


__all__ = ["PROJECT", "Stack", "operator_uri", "running_stack"]
