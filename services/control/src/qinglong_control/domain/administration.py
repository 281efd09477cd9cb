"""Administration (R-ADM-1..3, docs/decisions/0002): the rows it shows and what it decides.

Secrets it creates (operator tokens, Worker join tokens) are made here and leave only as
their digest and, once, in the response that created them: a retried create answers with
what the first call made and an empty secret. The repository (db/admin.py) feeds these
rules the rows it read under its locks and DB time.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, TypeVar

from qinglong_protocol import bounds

from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.sessions import LIVE_SESSION_STATES

#: Operator bearer tokens and Worker join tokens: prefix + unpadded base64url of 32 random
#: bytes (43 characters), 48 in all (admin_service.proto).
OPERATOR_TOKEN_PREFIX: Final = "qlo1_"  # noqa: S105 - a prefix, not a secret
JOIN_TOKEN_PREFIX: Final = "qlj1_"  # noqa: S105 - a prefix, not a secret
SECRET_BYTES: Final = 32
#: What OperatorToken.prefix shows: "qlo1_" and 6 more characters (36 bits of 256).
SHOWN_PREFIX_LENGTH: Final = len(OPERATOR_TOKEN_PREFIX) + 6
#: CreateWorkerRequest: "absent means one hour".
JOIN_TOKEN_TTL_DEFAULT_SECONDS: Final = 3600
#: The most items a list without paging returns (ListTokensResponse, ListRoleBindingsResponse).
TOKENS_LISTED_MAX: Final = 1000
ROLE_BINDINGS_LISTED_MAX: Final = 10000
MS_PER_SECOND: Final = 1000

#: Who may hold an operator token or a project role; Workers have certificates.
OPERATOR_KINDS: Final = frozenset({"user", "agent"})
#: The status every identity table calls "in effect"; anything else is disabled, revoked
#: or archived (kept for the record, never reused).
ACTIVE: Final = "active"


# --- secrets ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NewSecret:
    """A secret made for one response. Its plaintext is never in a repr (logs, errors)."""

    plaintext: str = field(repr=False)

    @property
    def digest(self) -> str:
        """What the database keeps: lowercase hex SHA-256 of the whole token."""
        return hashlib.sha256(self.plaintext.encode("ascii")).hexdigest()

    @property
    def shown_prefix(self) -> str:
        return self.plaintext[:SHOWN_PREFIX_LENGTH]


def _new_secret(prefix: str) -> NewSecret:
    encoded = base64.urlsafe_b64encode(secrets.token_bytes(SECRET_BYTES)).decode("ascii")
    return NewSecret(prefix + encoded.rstrip("="))


def new_operator_token() -> NewSecret:
    return _new_secret(OPERATOR_TOKEN_PREFIX)


def given_operator_token(text: str) -> NewSecret:
    """A token made elsewhere (a Kubernetes Secret) for bootstrap-admin to enroll; it must
    have the shape of one this server would issue."""
    token = text.strip()
    if bounds.OPERATOR_TOKEN_PATTERN.match(token) is None:
        raise ValueError("an operator token is 'qlo1_' followed by 43 base64url characters")
    return NewSecret(token)


def new_join_token() -> NewSecret:
    return _new_secret(JOIN_TOKEN_PREFIX)


# --- rows as the administration shows them ---------------------------------------------


@dataclass(frozen=True)
class ProjectRow:
    project_id: str
    display_name: str
    status: str  # active | archived
    version: int
    created_at_ms: int


@dataclass(frozen=True)
class PrincipalRow:
    principal_id: uuid.UUID
    kind: str  # user | agent | worker | service
    name: str
    status: str  # active | disabled
    cluster_admin: bool
    created_at_ms: int


@dataclass(frozen=True)
class TokenRow:
    token_id: uuid.UUID
    principal_id: uuid.UUID
    prefix: str | None  # None for tokens enrolled before administration existed
    status: str  # active | revoked
    created_at_ms: int
    expires_at_ms: int | None
    last_used_at_ms: int | None = None
    """Its newest audit row's time (a call it authenticated); None: never used, or that
    row is past the audit's retention (migration 0022)."""


@dataclass(frozen=True)
class BindingRow:
    project_id: str
    principal_id: uuid.UUID
    role: str
    status: str  # active | revoked
    version: int
    updated_at_ms: int
    principal_name: str


@dataclass(frozen=True)
class SessionSummary:
    session_id: uuid.UUID
    state: str  # online | draining | fenced | expired (session_state)
    generation: int
    renewed_at_ms: int
    remaining_ms: int
    agent_version: str
    executor_types: tuple[str, ...]
    max_concurrency: int
    passes_run_parameters: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerRow:
    worker_id: str
    principal_id: uuid.UUID
    status: str  # active | disabled
    created_at_ms: int
    session: SessionSummary | None
    live_attempts: int
    session_count: int
    project_ids: tuple[str, ...] | None
    """The projects whose Runs it is offered; None: every project."""
    cordoned: bool = False
    """Offered no new Run, and may claim none, until uncordoned."""


def check_projects_exist(project_ids: Sequence[str], inactive: Sequence[str]) -> None:
    """A Worker serves only active projects (a typo or a disabled project would leave it
    nothing to run); the refusal names the first other one by its place in the request."""
    absent = set(inactive)
    for index, project_id in enumerate(project_ids):
        if project_id in absent:
            raise Refused(
                Reason.PROJECT_NOT_FOUND,
                "no such active project",
                field=f"project_ids[{index}]",
            )


def worker_scope(project_ids: Sequence[str], all_projects: bool) -> tuple[str, ...] | None:
    """The projects a Worker serves (None: every project) from a request that names them
    or asks for every one. An empty list never means every project: a list emptied by
    mistake must not widen a Worker (SetWorkerProjects; CreateWorker passes
    ``all_projects`` for an empty list, its documented default)."""
    if all_projects and project_ids:
        raise Refused(
            Reason.FIELD_INVALID, "give project_ids or all_projects, not both", field="all_projects"
        )
    if not all_projects and not project_ids:
        raise Refused(
            Reason.FIELD_INVALID,
            "name at least one project, or ask for all_projects",
            field="project_ids",
        )
    return None if all_projects else tuple(project_ids)


@dataclass(frozen=True)
class AuditRow:
    audit_id: uuid.UUID
    occurred_at_ms: int
    principal_kind: str | None
    principal_id: str | None
    operation: str
    outcome: str
    reason: str | None
    project_id: str | None
    run_id: uuid.UUID | None
    worker_id: str | None
    peer: str | None
    principal_name: str | None  # a user's or agent's; None for other callers


@dataclass(frozen=True)
class AuditFilter:
    """ListAuditRecords' filters; None matches everything."""

    principal_id: str | None = None
    operation: str | None = None
    outcome: str | None = None
    start_ms: int | None = None  # inclusive
    end_ms: int | None = None  # exclusive


# --- decisions -------------------------------------------------------------------------

Row = TypeVar("Row")


def replay_or_new(by_request: Row | None, by_key: Row | None, what: str) -> Row | None:
    """AIP-155 for creates: the row this request id made before (a replay answers with it),
    or None to create one. A key another request took is ALREADY_EXISTS."""
    if by_request is not None:
        return by_request
    if by_key is not None:
        raise Refused(Reason.ALREADY_EXISTS, f"{what} already exists")
    return None


_NOT_FOUND: Final = {
    "project": Reason.PROJECT_NOT_FOUND,
    "principal": Reason.PRINCIPAL_NOT_FOUND,
    "token": Reason.TOKEN_NOT_FOUND,
    "Worker": Reason.WORKER_NOT_FOUND,
    "role binding": Reason.ROLE_BINDING_NOT_FOUND,
}


def not_found(what: str, field_path: str) -> Refused:
    """A project, principal, token, Worker or binding that does not exist (NOT_FOUND),
    naming the request field that named it."""
    return Refused(_NOT_FOUND[what], f"no such {what}", field=field_path)


def check_operator(principal: PrincipalRow | None) -> PrincipalRow:
    """Tokens and project roles are for users and agents only."""
    if principal is None:
        raise not_found("principal", "principal_id")
    if principal.kind not in OPERATOR_KINDS:
        raise Refused(
            Reason.FIELD_INVALID,
            "only a user or agent principal may hold this",
            field="principal_id",
        )
    return principal


def check_new_principal(kind: str, cluster_admin: bool) -> None:
    """An Agent is never a cluster admin: as one it could create a user, issue that user a
    token and approve its own held requests through it (SPEC R-CAN-2, R-OPS-2). Ingress
    refuses an Agent's AdminService call as well, whatever ``cluster_admins`` says."""
    if cluster_admin and kind == "agent":
        raise Refused(
            Reason.FIELD_INVALID,
            "an agent cannot be a cluster admin (it could approve its own held requests)",
            field="cluster_admin",
        )


def check_token_holder(principal: PrincipalRow | None) -> PrincipalRow:
    """A new token is issued only to an active user or agent."""
    holder = check_operator(principal)
    if holder.status != ACTIVE:
        raise Refused(Reason.STATE_CONFLICT, "the principal is disabled")
    return holder


def check_disable_principal(principal: PrincipalRow | None) -> PrincipalRow:
    """A Worker's principal is disabled with its Worker (DisableWorker), which also fences
    its sessions; disabling only the principal would leave its certificate working."""
    if principal is None:
        raise not_found("principal", "principal_id")
    if principal.kind == "worker":
        raise Refused(
            Reason.FIELD_INVALID,
            "a Worker's principal is disabled with DisableWorker",
            field="principal_id",
        )
    return principal


def check_not_last_cluster_admin(principal: PrincipalRow, others_active: bool) -> None:
    """Never disable the last active user cluster admin: nobody could administer the
    cluster any more, and bootstrap-admin (the Kubernetes migration Job) would refuse to
    make another under the name that is taken. ``others_active`` is read under the lock
    every change of the cluster admins takes, so two admins disabling each other cannot
    both succeed. A principal already disabled is answered as it is (nothing changes)."""
    if (
        principal.cluster_admin
        and principal.kind == "user"
        and principal.status == ACTIVE
        and not others_active
    ):
        raise Refused(
            Reason.LAST_CLUSTER_ADMIN,
            "this is the last active cluster admin; make another cluster admin first",
        )


def check_join_token_holder(status: str | None) -> None:
    """A new join token is issued only to an enrolled (``status`` found), active Worker."""
    if status is None:
        raise not_found("Worker", "worker_id")
    if status != ACTIVE:
        raise Refused(Reason.WORKER_DISABLED, "the Worker is disabled")


def check_rotation(old: TokenRow | None, holder: PrincipalRow | None) -> TokenRow:
    """A successor is issued for an active token of an active user or agent."""
    if old is None:
        raise not_found("token", "token_id")
    check_token_holder(holder)
    if old.status != ACTIVE:
        raise Refused(Reason.STATE_CONFLICT, "the token is revoked")
    return old


def expiry(now_ms: int, ttl_seconds: int | None) -> int | None:
    return None if ttl_seconds is None else now_ms + ttl_seconds * MS_PER_SECOND


def successor_expiry(old: TokenRow, now_ms: int) -> int | None:
    """A successor lives as long as its predecessor was issued for (none: no expiry)."""
    if old.expires_at_ms is None:
        return None
    return now_ms + (old.expires_at_ms - old.created_at_ms)


def overlap_expiry(old: TokenRow, now_ms: int, overlap_seconds: int) -> int:
    """When a replaced token stops: after the overlap, never later than it already would."""
    end = now_ms + overlap_seconds * MS_PER_SECOND
    return end if old.expires_at_ms is None else min(end, old.expires_at_ms)


def join_token_expiry(now_ms: int, ttl_seconds: int | None) -> int:
    """A join token always expires: one hour unless the admin said otherwise."""
    return now_ms + (ttl_seconds or JOIN_TOKEN_TTL_DEFAULT_SECONDS) * MS_PER_SECOND


def session_state(status: str, remaining_ms: int) -> tuple[str, int]:
    """A session as the fleet view shows it, with its time left: a live one past its
    expiry by DB time is expired (the reconcile cadence has not marked it yet), a replaced
    or closed one is fenced; only a live session has time left."""
    if status in LIVE_SESSION_STATES and remaining_ms > 0:
        return status, remaining_ms
    if status in LIVE_SESSION_STATES or status == "expired":
        return "expired", 0
    return "fenced", 0
