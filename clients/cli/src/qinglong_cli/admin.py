"""`qinglong admin …` and `qinglong worker list`: a cluster admin's commands (AdminService,
through ingress).

They authenticate with the cluster admin's bearer token: `--token-file` /
`$QINGLONG_ADMIN_TOKEN_FILE`, or the file `qinglong up` writes and names in stack.json
(`admin.token_file`); the connection is explicit (`--address`, `--ca-cert`, `--cert`,
`--key`) or the stack file's (ingress_client.py). Output, errors and exit codes are the
operator commands' (output.py, cli_errors.py).

A PRINCIPAL argument is a principal's name or its UUID; a name is looked up through
ListPrincipals first. Every create sends a fresh AIP-155 request_id, or `--request-id` for a
scripted retry: the retry answers with what the first call created. A secret (an issued
token, a join token) is in the answer to the call that created it and nowhere else, so it
is printed on stdout exactly once (a column of the table, a field of the JSON); a replayed
create answers without it, and the CLI says so on stderr.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import os
import re
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, TypeAlias

from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from qinglong.admin.v1 import admin_pb2, admin_service_pb2, admin_service_pb2_grpc
from qinglong_protocol.files import atomic_write

from qinglong_cli.cli_errors import ConfigurationError, NotFoundError, sent_once
from qinglong_cli.ingress_client import (
    ADMIN_TOKEN,
    PagedRequest,
    Session,
    add_connection_flags,
    add_paging_flags,
    add_request_id_flag,
    pages,
    print_pages,
    request_id_of,
    run_through_ingress,
)
from qinglong_cli.output import Printer, enum_names

#: What to do when a token's answer was lost: a repeat would show no secret.
_WHEN_AN_ISSUE_IS_LOST = (
    "list the principal's tokens (qinglong admin token list NAME), revoke any you cannot"
    " use and issue another"
)
_WHEN_A_JOIN_IS_LOST = "issue the Worker a new join token (qinglong admin worker join-token NAME)"
#: The top-level commands this module runs.
ADMIN_COMMANDS = frozenset({"admin", "worker"})

_Kind: TypeAlias = admin_pb2.PrincipalKind.ValueType
_ROLES = enum_names(admin_pb2.ProjectRole, "PROJECT_ROLE_")
_KINDS = enum_names(admin_pb2.PrincipalKind, "PRINCIPAL_KIND_")
_OUTCOMES = enum_names(admin_pb2.AuditOutcome, "AUDIT_OUTCOME_")
#: Who may hold a token or a project role.
_PEOPLE = frozenset({admin_pb2.PRINCIPAL_KIND_USER, admin_pb2.PRINCIPAL_KIND_AGENT})
_ANYONE = frozenset(_KINDS.values())
#: The largest page the contract allows: a name lookup reads every principal.
_LOOKUP_PAGE_SIZE = 500
#: `--since 15m`: an age, in seconds, minutes, hours or days.
_AGE = re.compile(r"(\d+)([smhd])")
_AGE_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3_600, "d": 86_400}
_UUID_LENGTH = 36


@dataclass(frozen=True)
class _Admin:
    """What every admin command uses: the stub, the call options and where to print."""

    stub: admin_service_pb2_grpc.AdminServiceAsyncStub
    call: dict[str, Any] = field(repr=False)  # holds the bearer token
    printer: Printer
    err: TextIO

    def bound(self, method: Callable[..., Awaitable[Any]]) -> Callable[[Any], Awaitable[Any]]:
        return functools.partial(method, **self.call)

    async def list_pages(
        self,
        method: Callable[..., Awaitable[Any]],
        request: PagedRequest,
        items: Callable[[Any], Iterable[Message]],
        args: argparse.Namespace,
    ) -> None:
        await print_pages(
            self.bound(method), request, items, self.printer, self.err, follow=args.all
        )

    def show_secret(
        self,
        answer: Message,
        field_name: str,
        what: str,
        request_id: str,
        save: Path | None = None,
    ) -> None:
        """Print the answer and its one-time secret (``field_name``); with ``save``, the
        secret goes to that file instead (0600, written whole or not at all) and is
        printed nowhere."""
        secret: str = getattr(answer, field_name)
        if secret and save is not None:
            try:
                atomic_write(save, secret.encode("ascii") + b"\n", 0o600)
            except OSError as error:
                # It is issued now and shown nowhere else: print it rather than lose it.
                self.printer.item(answer)
                raise ConfigurationError(
                    f"--save {save}: not written ({error.strerror}); the {what} is printed"
                    " above instead, shown only this once: store it now"
                ) from None
            shown = type(answer)()
            shown.CopyFrom(answer)
            shown.ClearField(field_name)
            self.printer.item(shown)
            print(f"the {what} was written to {save} (0600); it is shown nowhere", file=self.err)
            return
        self.printer.item(answer)
        if secret:
            print(f"the {what} above is shown only this once; store it now", file=self.err)
        else:
            print(
                f"request {request_id} was answered before: its {what} was shown then and "
                "cannot be shown again",
                file=self.err,
            )

    async def principal(self, name: str, kinds: Collection[_Kind]) -> admin_pb2.Principal:
        """The one principal among `kinds` called `name` (names are unique per kind)."""
        request = admin_service_pb2.ListPrincipalsRequest(
            page_size=_LOOKUP_PAGE_SIZE,
            kind=next(iter(kinds)) if len(kinds) == 1 else admin_pb2.PRINCIPAL_KIND_UNSPECIFIED,
        )
        matches: list[admin_pb2.Principal] = [
            principal
            async for page in pages(self.bound(self.stub.ListPrincipals), request)
            for principal in page.principals
            if principal.kind in kinds and principal.name == name
        ]
        if not matches:
            raise NotFoundError(f"no {_kind_names(kinds)} is named {name!r}")
        if len(matches) > 1:
            found = ", ".join(f"{_kind_name(p.kind)} {p.principal_id}" for p in matches)
            raise ConfigurationError(
                f"{name!r} names more than one principal ({found}); pass its id"
            )
        return matches[0]

    async def principal_id(self, given: str, kinds: Collection[_Kind] = _PEOPLE) -> str:
        # An id is passed as given: the server, not a listing, says whether it exists.
        canonical = _canonical_uuid(given)
        if canonical is not None:
            return canonical
        return (await self.principal(given, kinds)).principal_id


def _canonical_uuid(text: str) -> str | None:
    # Only the 36-character form: a slug name may be 32 hex digits, which uuid.UUID takes.
    if len(text) != _UUID_LENGTH:
        return None
    try:
        return str(uuid.UUID(text))
    except ValueError:
        return None


def _kind_name(kind: _Kind) -> str:
    return next(name for name, value in _KINDS.items() if value == kind)


def _kind_names(kinds: Collection[_Kind]) -> str:
    if set(kinds) == _ANYONE:
        return "principal"
    return " or ".join(sorted(_kind_name(kind) for kind in kinds))


def _moment(text: str) -> Timestamp:
    """`--since`/`--until`: an RFC 3339 time (UTC if it names no offset) or an age (`15m`)."""
    age = _AGE.fullmatch(text)
    try:
        if age is not None:
            seconds = int(age[1]) * _AGE_UNIT_SECONDS[age[2]]
            moment = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=seconds)
        else:
            moment = dt.datetime.fromisoformat(text)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(
            f"not a time: {text!r} (say 2026-01-31T12:00:00Z, or an age like 90s, 15m, 2h, 7d)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    timestamp = Timestamp()
    timestamp.FromDatetime(moment)
    return timestamp


# --- commands -------------------------------------------------------------------------------

_Handler = Callable[[_Admin, argparse.Namespace], Awaitable[None]]


def _one_call(
    method: str, request: Callable[[argparse.Namespace], Message], answer: str
) -> _Handler:
    """A command that is one call of the stub's `method` with the `request` its arguments
    make, printing the `answer` field of the response."""

    async def handler(admin: _Admin, args: argparse.Namespace) -> None:
        sent = request(args)
        call = getattr(admin.stub, method)(sent, **admin.call)
        request_id = getattr(sent, "request_id", "")
        response = await (sent_once(call, request_id) if request_id else call)
        admin.printer.item(getattr(response, answer))

    return handler


_project_create = _one_call(
    "CreateProject",
    lambda args: admin_service_pb2.CreateProjectRequest(
        request_id=request_id_of(args),
        project_id=args.project_id,
        display_name=args.display_name or args.project_id,
    ),
    "project",
)
_project_get = _one_call(
    "GetProject",
    lambda args: admin_service_pb2.GetProjectRequest(project_id=args.project_id),
    "project",
)
_project_disable = _one_call(
    "DisableProject",
    lambda args: admin_service_pb2.DisableProjectRequest(project_id=args.project_id),
    "project",
)
_principal_create = _one_call(
    "CreatePrincipal",
    lambda args: admin_service_pb2.CreatePrincipalRequest(
        request_id=request_id_of(args),
        kind=_KINDS[args.kind],
        name=args.name,
        cluster_admin=args.cluster_admin,
    ),
    "principal",
)
_token_revoke = _one_call(
    "RevokeToken",
    lambda args: admin_service_pb2.RevokeTokenRequest(token_id=args.token_id),
    "revoked",
)
_worker_disable = _one_call(
    "DisableWorker",
    lambda args: admin_service_pb2.DisableWorkerRequest(worker_id=args.worker_id),
    "worker",
)


def _set_cordon(cordoned: bool) -> _Handler:
    """`worker cordon` (True) and `worker uncordon` (False): one call, one flag."""
    return _one_call(
        "SetWorkerCordoned",
        lambda args: admin_service_pb2.SetWorkerCordonedRequest(
            worker_id=args.worker_id, cordoned=cordoned
        ),
        "worker",
    )


_worker_projects = _one_call(
    "SetWorkerProjects",
    lambda args: admin_service_pb2.SetWorkerProjectsRequest(
        worker_id=args.worker_id, project_ids=args.projects, all_projects=args.all_projects
    ),
    "worker",
)


def _listing(
    method: str,
    request_type: Callable[..., Any],
    items: str,
    filters: Callable[[argparse.Namespace], dict[str, Any]] = lambda args: {},
) -> _Handler:
    """A paged list command: the stub's `method`, whose pages hold `items`; the request
    gets `--page-size`, `--page-token` and the fields `filters` reads from the arguments."""

    async def handler(admin: _Admin, args: argparse.Namespace) -> None:
        request = request_type(
            page_size=args.page_size, page_token=args.page_token, **filters(args)
        )
        await admin.list_pages(
            getattr(admin.stub, method), request, lambda page: getattr(page, items), args
        )

    return handler


_project_list = _listing("ListProjects", admin_service_pb2.ListProjectsRequest, "projects")
_principal_list = _listing(
    "ListPrincipals",
    admin_service_pb2.ListPrincipalsRequest,
    "principals",
    lambda args: {"kind": _KINDS[args.kind]},
)
_worker_list = _listing("ListWorkers", admin_service_pb2.ListWorkersRequest, "workers")


async def _principal_get(admin: _Admin, args: argparse.Namespace) -> None:
    principal_id = await admin.principal_id(args.principal, {_KINDS[args.kind]})
    got = await admin.stub.GetPrincipal(
        admin_service_pb2.GetPrincipalRequest(principal_id=principal_id), **admin.call
    )
    if got.principal.kind != _KINDS[args.kind]:
        # An id names any principal; `user get` shows only a user, as a name would.
        raise NotFoundError(f"no {args.kind} has the id {principal_id}")
    admin.printer.item(got.principal)


async def _principal_disable(admin: _Admin, args: argparse.Namespace) -> None:
    principal_id = await admin.principal_id(args.principal, {_KINDS[args.kind]})
    disabled = await admin.stub.DisablePrincipal(
        admin_service_pb2.DisablePrincipalRequest(principal_id=principal_id), **admin.call
    )
    admin.printer.item(disabled.principal)


def _check_save(path: Path | None, *, replaces: bool) -> None:
    """Before a token is issued: a `--save` file that could not be written would lose it,
    and one written over an existing file would lose the token that file held (only a
    rotation, whose old token it may be, may replace a file)."""
    if path is None:
        return
    directory = path.parent
    if not directory.is_dir() or not os.access(directory, os.W_OK):
        raise ConfigurationError(f"--save {path}: the directory {directory} is not writable")
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise ConfigurationError(f"--save {path}: not a regular file")
    if path.exists() and not replaces:
        raise ConfigurationError(
            f"--save {path}: the file exists, and a token it holds would be lost; choose a new file"
        )


async def _token_issue(admin: _Admin, args: argparse.Namespace) -> None:
    _check_save(args.save, replaces=False)
    request = admin_service_pb2.IssueTokenRequest(
        request_id=request_id_of(args), principal_id=await admin.principal_id(args.principal)
    )
    if args.ttl is not None:
        request.ttl_seconds = args.ttl
    issued = await sent_once(
        admin.stub.IssueToken(request, **admin.call),
        request.request_id,
        secret_hint=_WHEN_AN_ISSUE_IS_LOST,
    )
    admin.show_secret(issued, "token", "token", request.request_id, args.save)


async def _token_list(admin: _Admin, args: argparse.Namespace) -> None:
    listed = await admin.stub.ListTokens(
        admin_service_pb2.ListTokensRequest(principal_id=await admin.principal_id(args.principal)),
        **admin.call,
    )
    for token in listed.tokens:
        admin.printer.item(token)


async def _token_rotate(admin: _Admin, args: argparse.Namespace) -> None:
    _check_save(args.save, replaces=True)
    request = admin_service_pb2.RotateTokenRequest(
        request_id=request_id_of(args), token_id=args.token_id, overlap_seconds=args.overlap
    )
    rotated = await sent_once(
        admin.stub.RotateToken(request, **admin.call),
        request.request_id,
        secret_hint=_WHEN_AN_ISSUE_IS_LOST,
    )
    admin.show_secret(rotated, "token", "token", request.request_id, args.save)


async def _role_grant(admin: _Admin, args: argparse.Namespace) -> None:
    granted = await admin.stub.GrantRole(
        admin_service_pb2.GrantRoleRequest(
            project_id=args.project_id,
            principal_id=await admin.principal_id(args.principal),
            role=_ROLES[args.role],
        ),
        **admin.call,
    )
    admin.printer.item(granted.binding)


async def _role_revoke(admin: _Admin, args: argparse.Namespace) -> None:
    revoked = await admin.stub.RevokeRole(
        admin_service_pb2.RevokeRoleRequest(
            project_id=args.project_id, principal_id=await admin.principal_id(args.principal)
        ),
        **admin.call,
    )
    admin.printer.item(revoked.binding)


async def _role_list(admin: _Admin, args: argparse.Namespace) -> None:
    listed = await admin.stub.ListRoleBindings(
        admin_service_pb2.ListRoleBindingsRequest(project_id=args.project_id), **admin.call
    )
    for binding in listed.bindings:
        admin.printer.item(binding)


async def _worker_create(admin: _Admin, args: argparse.Namespace) -> None:
    _check_save(args.save, replaces=False)
    request = admin_service_pb2.CreateWorkerRequest(
        request_id=request_id_of(args), worker_id=args.worker_id, project_ids=args.projects
    )
    if args.join_token_ttl is not None:
        request.join_token_ttl_seconds = args.join_token_ttl
    created = await sent_once(
        admin.stub.CreateWorker(request, **admin.call),
        request.request_id,
        secret_hint=_WHEN_A_JOIN_IS_LOST,
    )
    admin.show_secret(created, "join_token", "join token", request.request_id, args.save)


async def _worker_join_token(admin: _Admin, args: argparse.Namespace) -> None:
    _check_save(args.save, replaces=True)
    request = admin_service_pb2.IssueJoinTokenRequest(
        request_id=request_id_of(args), worker_id=args.worker_id
    )
    if args.ttl is not None:
        request.ttl_seconds = args.ttl
    issued = await sent_once(
        admin.stub.IssueJoinToken(request, **admin.call),
        request.request_id,
        secret_hint=_WHEN_A_JOIN_IS_LOST,
    )
    # Printed as CreateWorker's answer, which has the very same fields (and a table).
    shown = admin_service_pb2.CreateWorkerResponse(
        worker=issued.worker,
        join_token=issued.join_token,
        join_token_expire_time=issued.join_token_expire_time,
    )
    admin.show_secret(shown, "join_token", "join token", request.request_id, args.save)


async def _audit_list(admin: _Admin, args: argparse.Namespace) -> None:
    request = admin_service_pb2.ListAuditRecordsRequest(
        page_size=args.page_size,
        page_token=args.page_token,
        principal_id=await _audited_principal(admin, args.principal),
        operation=args.operation,
        outcome=_OUTCOMES[args.outcome] if args.outcome else admin_pb2.AUDIT_OUTCOME_UNSPECIFIED,
    )
    if args.since is not None:
        request.start_time.CopyFrom(args.since)
    if args.until is not None:
        request.end_time.CopyFrom(args.until)
    await admin.list_pages(admin.stub.ListAuditRecords, request, lambda page: page.records, args)


async def _audited_principal(admin: _Admin, given: str) -> str:
    """The id the audit records for `given`: a Worker's worker id, anyone else's UUID."""
    if not given or _canonical_uuid(given) is not None:
        return given
    principal = await admin.principal(given, _ANYONE)
    if principal.kind == admin_pb2.PRINCIPAL_KIND_WORKER:
        return principal.name
    return principal.principal_id


# --- parser ---------------------------------------------------------------------------------


def add_admin_commands(commands: Any, default_stack: Path) -> None:
    def command(
        group: Any, name: str, help_text: str, handler: _Handler
    ) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = group.add_parser(name, help=help_text)
        add_connection_flags(parser, default_stack, ADMIN_TOKEN)
        parser.set_defaults(admin_handler=handler)
        return parser

    admin = commands.add_parser(
        "admin",
        help="administer projects, people, tokens, roles and Workers; read the audit",
        description="AdminService through ingress; only a cluster admin may call it.",
    ).add_subparsers(dest="noun", required=True)
    _add_project_commands(_group(admin, "project", "projects"), command)
    for kind in ("user", "agent"):
        _add_principal_commands(_group(admin, kind, f"{kind} principals"), command, kind)
    _add_token_commands(_group(admin, "token", "bearer tokens of users and agents"), command)
    _add_role_commands(_group(admin, "role", "role bindings of a project"), command)
    workers = _group(admin, "worker", "enrolled Workers")
    _add_worker_create(workers, command)
    _add_worker_join_token(workers, command)
    disable = command(
        workers, "disable", "disable a Worker and fence its sessions", _worker_disable
    )
    disable.add_argument("worker_id", metavar="NAME")
    cordon = command(
        workers,
        "cordon",
        "offer a Worker no new Run (its running ones go on): before maintenance, wait for"
        " its LOAD to reach 0, then stop it",
        _set_cordon(True),
    )
    cordon.add_argument("worker_id", metavar="NAME")
    uncordon = command(
        workers, "uncordon", "offer a cordoned Worker Runs again", _set_cordon(False)
    )
    uncordon.add_argument("worker_id", metavar="NAME")
    scope = command(
        workers, "projects", "change which projects' Runs a Worker is offered", _worker_projects
    )
    scope.add_argument("worker_id", metavar="NAME")
    which = scope.add_mutually_exclusive_group(required=True)
    _add_project_flag(which)
    which.add_argument(
        "--all-projects", action="store_true", help="offer it the Runs of every project"
    )
    _add_worker_list(workers, command)
    audit = _group(admin, "audit", "the security audit")
    _add_audit_list(audit, command)
    # The fleet view an admin reaches for most: also top-level.
    _add_worker_list(_group(commands, "worker", "the fleet: Workers and their sessions"), command)


_Command = Callable[[Any, str, str, _Handler], argparse.ArgumentParser]


def _group(parent: Any, name: str, help_text: str) -> Any:
    return parent.add_parser(name, help=help_text).add_subparsers(dest="action", required=True)


def _add_project_commands(group: Any, command: _Command) -> None:
    create = command(group, "create", "create a project", _project_create)
    create.add_argument("project_id")
    create.add_argument("--display-name", help="human-readable name (default: the id)")
    add_request_id_flag(create)
    add_paging_flags(
        command(group, "list", "list projects, oldest first", _project_list), "projects"
    )
    command(group, "get", "show a project", _project_get).add_argument("project_id")
    command(group, "disable", "disable a project", _project_disable).add_argument("project_id")


def _add_principal_commands(group: Any, command: _Command, kind: str) -> None:
    create = command(group, "create", f"create a {kind}", _principal_create)
    create.add_argument("name")
    if kind == "user":
        create.add_argument(
            "--cluster-admin",
            action="store_true",
            help="may call AdminService (not a project role)",
        )
    else:
        # An agent is never a cluster admin (control refuses it: docs/approvals.md).
        create.set_defaults(cluster_admin=False)
    add_request_id_flag(create)
    listing = command(group, "list", f"list {kind}s, oldest first", _principal_list)
    add_paging_flags(listing, f"{kind}s")
    get = command(group, "get", f"show a {kind}", _principal_get)
    get.add_argument("principal", metavar=kind.upper(), help="name or id")
    disable = command(
        group, "disable", f"disable a {kind} and all its credentials", _principal_disable
    )
    disable.add_argument("principal", metavar=kind.upper(), help="name or id")
    for parser in (create, listing, get, disable):
        parser.set_defaults(kind=kind)


def _add_token_commands(group: Any, command: _Command) -> None:
    issue = command(group, "issue", "issue a bearer token (shown once)", _token_issue)
    issue.add_argument("principal", metavar="PRINCIPAL", help="user or agent: name or id")
    issue.add_argument("--ttl", type=int, help="lifetime in seconds (default: no expiry)")
    _add_save(issue)
    add_request_id_flag(issue)
    listing = command(
        group, "list", "list a principal's tokens, newest first, with their last use", _token_list
    )
    listing.add_argument("principal", metavar="PRINCIPAL", help="user or agent: name or id")
    command(group, "revoke", "revoke a token at once", _token_revoke).add_argument("token_id")
    rotate = command(group, "rotate", "issue a successor token (shown once)", _token_rotate)
    rotate.add_argument("token_id")
    rotate.add_argument(
        "--overlap",
        type=int,
        default=0,
        help="seconds the old token keeps working (default 0: it stops now)",
    )
    _add_save(rotate)
    add_request_id_flag(rotate)


_SAVE_HELP_BEARER = (
    "write the token to FILE (0600) instead of printing it; pass FILE as --token-file."
    " `issue` refuses an existing FILE; `rotate` may replace one (the old token's own file)"
)
_SAVE_HELP_JOIN = (
    "write the join token to FILE (0600) instead of printing it; hand FILE to the Worker's"
    " `qinglong-worker join --token-file`. `worker create` refuses an existing FILE;"
    " `worker join-token` may replace one (the join tokens before it stop working)"
)


def _add_save(parser: argparse.ArgumentParser, help_text: str = _SAVE_HELP_BEARER) -> None:
    parser.add_argument("--save", type=Path, metavar="FILE", help=help_text)


def _add_role_commands(group: Any, command: _Command) -> None:
    grant = command(group, "grant", "grant or change a principal's role", _role_grant)
    grant.add_argument("project_id", metavar="PROJECT")
    grant.add_argument("principal", metavar="PRINCIPAL", help="user or agent: name or id")
    grant.add_argument("role", choices=sorted(_ROLES))
    revoke = command(group, "revoke", "revoke a principal's role", _role_revoke)
    revoke.add_argument("project_id", metavar="PROJECT")
    revoke.add_argument("principal", metavar="PRINCIPAL", help="user or agent: name or id")
    listing = command(group, "list", "list a project's role bindings", _role_list)
    listing.add_argument("project_id", metavar="PROJECT")


def _add_worker_create(group: Any, command: _Command) -> None:
    create = command(group, "create", "enroll a Worker; prints its join token once", _worker_create)
    create.add_argument("worker_id", metavar="NAME")
    create.add_argument(
        "--join-token-ttl", type=int, help="seconds the join token is valid (default 3600)"
    )
    _add_project_flag(create, " (default: every project)")
    add_request_id_flag(create)
    _add_save(create, _SAVE_HELP_JOIN)


def _add_worker_join_token(group: Any, command: _Command) -> None:
    issue = command(
        group,
        "join-token",
        "issue an enrolled Worker a new join token (shown once); earlier ones stop working",
        _worker_join_token,
    )
    issue.add_argument("worker_id", metavar="NAME")
    issue.add_argument("--ttl", type=int, help="seconds the join token is valid (default 3600)")
    add_request_id_flag(issue)
    _add_save(issue, _SAVE_HELP_JOIN)


def _add_project_flag(parser: Any, default: str = "") -> None:
    # A Worker's tasks run as its own user and can act as the Worker: Workers shared by
    # projects join their trust (docs/worker-operations.md).
    parser.add_argument(
        "--project",
        dest="projects",
        action="append",
        default=[],
        metavar="PROJECT",
        help=f"offer it this project's Runs; repeat for more{default}",
    )


def _add_worker_list(group: Any, command: _Command) -> None:
    listing = command(group, "list", "list Workers with their session and load", _worker_list)
    add_paging_flags(listing, "Workers")


def _add_audit_list(group: Any, command: _Command) -> None:
    listing = command(group, "list", "list audit records, newest first", _audit_list)
    listing.add_argument("--principal", default="", help="the caller: name or id")
    listing.add_argument("--operation", default="", help="e.g. WorkerService/ClaimOffer")
    listing.add_argument("--outcome", choices=sorted(_OUTCOMES), help="only calls that ended so")
    listing.add_argument("--since", type=_moment, help="RFC 3339 time or an age (15m, 2h, 7d)")
    listing.add_argument("--until", type=_moment, help="RFC 3339 time or an age")
    add_paging_flags(listing, "records")


# --- running --------------------------------------------------------------------------------


async def run_admin_command(
    args: argparse.Namespace, out: TextIO, err: TextIO | None = None
) -> int:
    """Run one admin command; the process exit code (see cli_errors)."""
    return await run_through_ingress(args, ADMIN_TOKEN, _dispatch, out, err, needs_project=False)


async def _dispatch(args: argparse.Namespace, session: Session) -> None:
    stub = admin_service_pb2_grpc.AdminServiceStub(session.channel)
    admin = _Admin(stub, session.call_options(), session.printer, session.err)
    await args.admin_handler(admin, args)
