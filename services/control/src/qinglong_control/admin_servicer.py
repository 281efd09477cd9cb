"""The AdminService half of RuntimeService: what ingress forwards from a cluster admin.

Translation only, like servicer.py: each method converts the public request
(admin_wire.py), runs one administration transaction (db/admin.py) on the admin role's
own small pool, and renders the answer. The runtime pool is used for one thing: fencing a
disabled Worker's sessions, which only the runtime role may do. A control replica started
without an admin database URL answers every method here UNAVAILABLE.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from qinglong.admin.v1 import admin_service_pb2 as admin_api
from qinglong.runtime.v1 import caller_pb2, runtime_service_pb2, runtime_service_pb2_grpc
from qinglong_protocol.identities import worker_uri

from qinglong_control import admin_wire, paging, wire
from qinglong_control.db import admin, sessions
from qinglong_control.domain.administration import worker_scope
from qinglong_control.domain.refusals import Reason, Refused

Context = grpc.aio.ServicerContext[Any, Any]
Pool = AsyncConnectionPool[AsyncConnection[Any]]
rt = runtime_service_pb2


class AdminMethods(runtime_service_pb2_grpc.RuntimeServiceServicer):
    """The forwarded AdminService methods; RuntimeServicer adds the runtime ones."""

    def __init__(self, runtime_pool: Pool, admin_pool: Pool | None, trust_domain: str) -> None:
        self._fencing_pool = runtime_pool
        self._admin_pool = admin_pool
        self._trust_domain = trust_domain

    @asynccontextmanager
    async def _admin(self, caller: caller_pb2.Caller) -> AsyncIterator[AsyncConnection[Any]]:
        """An admin-role connection for a call from a cluster admin, checked again."""
        principal_id = admin_wire.admin_of(caller)
        if self._admin_pool is None:
            raise Refused(
                Reason.STORAGE_UNAVAILABLE,
                "administration is not configured on this control replica"
                " (no --admin-database-url)",
            )
        async with self._admin_pool.connection() as conn:
            await admin.check_cluster_admin(conn, principal_id)
            yield conn

    # --- projects ---------------------------------------------------------------------

    async def CreateProject(self, request: rt.CreateProjectRequest, context: Context) -> Any:
        public = request.request
        async with self._admin(request.caller) as conn:
            row = await admin.create_project(
                conn, public.request_id, public.project_id, public.display_name
            )
        return rt.CreateProjectResponse(
            response=admin_api.CreateProjectResponse(project=admin_wire.project(row))
        )

    async def ListProjects(self, request: rt.ListProjectsRequest, context: Context) -> Any:
        public = request.request
        after = paging.time_and_slug(public.page_token)
        async with self._admin(request.caller) as conn:
            page = await admin.list_projects(
                conn, limit=wire.page_size(public.page_size), after=after
            )
        return rt.ListProjectsResponse(
            response=admin_api.ListProjectsResponse(
                projects=[admin_wire.project(row) for row in page.rows],
                next_page_token=admin_wire.next_page_token(page, admin_wire.project_key),
            )
        )

    async def GetProject(self, request: rt.GetProjectRequest, context: Context) -> Any:
        async with self._admin(request.caller) as conn:
            row = await admin.get_project(conn, request.request.project_id)
        return rt.GetProjectResponse(
            response=admin_api.GetProjectResponse(project=admin_wire.project(row))
        )

    async def DisableProject(self, request: rt.DisableProjectRequest, context: Context) -> Any:
        async with self._admin(request.caller) as conn:
            row = await admin.disable_project(conn, request.request.project_id)
        return rt.DisableProjectResponse(
            response=admin_api.DisableProjectResponse(project=admin_wire.project(row))
        )

    # --- principals -------------------------------------------------------------------

    async def CreatePrincipal(self, request: rt.CreatePrincipalRequest, context: Context) -> Any:
        public = request.request
        async with self._admin(request.caller) as conn:
            row = await admin.create_principal(
                conn,
                public.request_id,
                admin_wire.KINDS[public.kind],
                public.name,
                cluster_admin=public.cluster_admin,
            )
        return rt.CreatePrincipalResponse(
            response=admin_api.CreatePrincipalResponse(principal=admin_wire.principal(row))
        )

    async def ListPrincipals(self, request: rt.ListPrincipalsRequest, context: Context) -> Any:
        public = request.request
        after = paging.time_and_id(public.page_token)
        async with self._admin(request.caller) as conn:
            page = await admin.list_principals(
                conn,
                kinds=admin_wire.principal_kinds(public.kind),
                limit=wire.page_size(public.page_size),
                after=after,
            )
        return rt.ListPrincipalsResponse(
            response=admin_api.ListPrincipalsResponse(
                principals=[admin_wire.principal(row) for row in page.rows],
                next_page_token=admin_wire.next_page_token(page, admin_wire.principal_key),
            )
        )

    async def GetPrincipal(self, request: rt.GetPrincipalRequest, context: Context) -> Any:
        async with self._admin(request.caller) as conn:
            row = await admin.get_principal(
                conn,
                uuid.UUID(request.request.principal_id),
                tuple(admin_wire.KINDS.values()),  # what the wire shows (ListPrincipals)
            )
        return rt.GetPrincipalResponse(
            response=admin_api.GetPrincipalResponse(principal=admin_wire.principal(row))
        )

    async def DisablePrincipal(self, request: rt.DisablePrincipalRequest, context: Context) -> Any:
        async with self._admin(request.caller) as conn:
            row = await admin.disable_principal(conn, uuid.UUID(request.request.principal_id))
        return rt.DisablePrincipalResponse(
            response=admin_api.DisablePrincipalResponse(principal=admin_wire.principal(row))
        )

    # --- operator tokens --------------------------------------------------------------

    async def IssueToken(self, request: rt.IssueTokenRequest, context: Context) -> Any:
        public = request.request
        async with self._admin(request.caller) as conn:
            issued = await admin.issue_token(
                conn,
                uuid.UUID(public.principal_id),
                public.request_id,
                admin_wire.optional(public, "ttl_seconds"),
            )
        return rt.IssueTokenResponse(
            response=admin_api.IssueTokenResponse(
                token=issued.secret, issued=admin_wire.token(issued.token)
            )
        )

    async def ListTokens(self, request: rt.ListTokensRequest, context: Context) -> Any:
        async with self._admin(request.caller) as conn:
            rows = await admin.list_tokens(conn, uuid.UUID(request.request.principal_id))
        return rt.ListTokensResponse(
            response=admin_api.ListTokensResponse(tokens=[admin_wire.token(row) for row in rows])
        )

    async def RevokeToken(self, request: rt.RevokeTokenRequest, context: Context) -> Any:
        async with self._admin(request.caller) as conn:
            row = await admin.revoke_token(conn, uuid.UUID(request.request.token_id))
        return rt.RevokeTokenResponse(
            response=admin_api.RevokeTokenResponse(revoked=admin_wire.token(row))
        )

    async def RotateToken(self, request: rt.RotateTokenRequest, context: Context) -> Any:
        public = request.request
        async with self._admin(request.caller) as conn:
            rotated = await admin.rotate_token(
                conn, uuid.UUID(public.token_id), public.request_id, public.overlap_seconds
            )
        return rt.RotateTokenResponse(
            response=admin_api.RotateTokenResponse(
                token=rotated.issued.secret,
                issued=admin_wire.token(rotated.issued.token),
                replaced=admin_wire.token(rotated.replaced),
            )
        )

    # --- role bindings ----------------------------------------------------------------

    async def GrantRole(self, request: rt.GrantRoleRequest, context: Context) -> Any:
        public = request.request
        async with self._admin(request.caller) as conn:
            row = await admin.grant_role(
                conn,
                public.project_id,
                uuid.UUID(public.principal_id),
                admin_wire.ROLES[public.role],
            )
        return rt.GrantRoleResponse(
            response=admin_api.GrantRoleResponse(binding=admin_wire.binding(row))
        )

    async def RevokeRole(self, request: rt.RevokeRoleRequest, context: Context) -> Any:
        public = request.request
        async with self._admin(request.caller) as conn:
            row = await admin.revoke_role(conn, public.project_id, uuid.UUID(public.principal_id))
        return rt.RevokeRoleResponse(
            response=admin_api.RevokeRoleResponse(binding=admin_wire.binding(row))
        )

    async def ListRoleBindings(self, request: rt.ListRoleBindingsRequest, context: Context) -> Any:
        async with self._admin(request.caller) as conn:
            rows = await admin.list_role_bindings(conn, request.request.project_id)
        return rt.ListRoleBindingsResponse(
            response=admin_api.ListRoleBindingsResponse(
                bindings=[admin_wire.binding(row) for row in rows]
            )
        )

    # --- Workers ----------------------------------------------------------------------

    async def CreateWorker(self, request: rt.CreateWorkerRequest, context: Context) -> Any:
        public = request.request
        worker_id = public.worker_id
        async with self._admin(request.caller) as conn:
            enrolled = await admin.create_worker(
                conn,
                public.request_id,
                worker_id,
                worker_uri(self._trust_domain, worker_id),
                admin_wire.optional(public, "join_token_ttl_seconds"),
                # An empty list is every project here: CreateWorker's documented default.
                tuple(public.project_ids) or None,
            )
        return rt.CreateWorkerResponse(
            response=admin_api.CreateWorkerResponse(
                worker=admin_wire.worker(enrolled.worker),
                join_token=enrolled.join_token,
                join_token_expire_time=wire.timestamp(enrolled.join_expires_at_ms),
            )
        )

    async def IssueJoinToken(self, request: rt.IssueJoinTokenRequest, context: Context) -> Any:
        public = request.request
        async with self._admin(request.caller) as conn:
            issued = await admin.issue_join_token(
                conn,
                public.worker_id,
                public.request_id,
                admin_wire.optional(public, "ttl_seconds"),
            )
        return rt.IssueJoinTokenResponse(
            response=admin_api.IssueJoinTokenResponse(
                worker=admin_wire.worker(issued.worker),
                join_token=issued.join_token,
                join_token_expire_time=wire.timestamp(issued.join_expires_at_ms),
            )
        )

    async def ListWorkers(self, request: rt.ListWorkersRequest, context: Context) -> Any:
        public = request.request
        after = paging.after_slug(public.page_token)
        async with self._admin(request.caller) as conn:
            page = await admin.list_workers(
                conn, limit=wire.page_size(public.page_size), after=after
            )
        return rt.ListWorkersResponse(
            response=admin_api.ListWorkersResponse(
                workers=[admin_wire.worker(row) for row in page.rows],
                next_page_token=admin_wire.next_page_token(page, admin_wire.worker_key),
            )
        )

    async def DisableWorker(self, request: rt.DisableWorkerRequest, context: Context) -> Any:
        """The identity first (its next call is refused at ingress), then its sessions
        (its next fenced command fails SESSION_FENCED). A retry after a failure between
        the two finds the identity disabled and fences again."""
        worker_id = request.request.worker_id
        async with self._admin(request.caller) as conn:
            await admin.disable_worker(conn, worker_id)
        async with self._fencing_pool.connection() as conn:
            await sessions.fence_sessions(conn, worker_id)
        async with self._admin(request.caller) as conn:
            row = await admin.get_worker(conn, worker_id)
        return rt.DisableWorkerResponse(
            response=admin_api.DisableWorkerResponse(worker=admin_wire.worker(row))
        )

    async def SetWorkerProjects(
        self, request: rt.SetWorkerProjectsRequest, context: Context
    ) -> Any:
        public = request.request
        projects = worker_scope(public.project_ids, public.all_projects)
        async with self._admin(request.caller) as conn:
            row = await admin.set_worker_projects(conn, public.worker_id, projects)
        return rt.SetWorkerProjectsResponse(
            response=admin_api.SetWorkerProjectsResponse(worker=admin_wire.worker(row))
        )

    async def SetWorkerCordoned(
        self, request: rt.SetWorkerCordonedRequest, context: Context
    ) -> Any:
        """Cordon (or uncordon) in the admin role's transaction; then, with the runtime
        role, which alone may write offers, give the offers a cordoned Worker holds back to
        the pool. A failure between the two leaves them to expire; a retry withdraws them."""
        public = request.request
        async with self._admin(request.caller) as conn:
            row = await admin.set_worker_cordoned(conn, public.worker_id, public.cordoned)
        if public.cordoned:
            async with self._fencing_pool.connection() as conn:
                await sessions.withdraw_worker_offers(conn, public.worker_id)
        return rt.SetWorkerCordonedResponse(
            response=admin_api.SetWorkerCordonedResponse(worker=admin_wire.worker(row))
        )

    # --- the security audit -----------------------------------------------------------

    async def ListAuditRecords(self, request: rt.ListAuditRecordsRequest, context: Context) -> Any:
        public = request.request
        before = paging.time_and_id(public.page_token)
        async with self._admin(request.caller) as conn:
            page = await admin.list_audit(
                conn,
                admin_wire.audit_filter(public),
                limit=wire.page_size(public.page_size),
                before=before,
            )
        return rt.ListAuditRecordsResponse(
            response=admin_api.ListAuditRecordsResponse(
                records=[admin_wire.audit_record(row) for row in page.rows],
                next_page_token=admin_wire.next_page_token(page, admin_wire.audit_key),
            )
        )
