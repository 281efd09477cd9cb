"""What the operator CLI says when something goes wrong, and its exit codes.

Errors go to stderr, never stdout (stdout is the answer a script reads). A refusal by the
server shows its gRPC code, its ErrorInfo reason, its message and every field violation
of its BadRequest. Exit codes:

* 0 — done;
* 1 — the server refused the request (invalid, not found, not allowed, a conflict), or
  a name the command was given matches nothing the server listed;
* 2 — a usage or local configuration problem (bad flags, an unreadable stack file);
* 3 — the stack could not be reached, or answered UNAVAILABLE: try again later;
* 4 — `run watch --exit-status`: the Run ended, but not `succeeded`;
* 5 — the request is held for a person's approval (an Agent's cancel, R-OPS-2): nothing
  was done yet; stderr names the approval request.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Final, TextIO, TypeVar

import grpc
from qinglong_protocol.errors import (
    APPROVAL_ID,
    error_info_of,
    error_reason_of,
    field_violations_of,
)

EXIT_OK: Final = 0
EXIT_REFUSED: Final = 1
EXIT_USAGE: Final = 2
EXIT_UNAVAILABLE: Final = 3
#: `run watch --exit-status`: the Run ended, but not `succeeded`.
EXIT_RUN_NOT_SUCCEEDED: Final = 4
#: Held for approval: not refused, not done either — a script must not read it as done.
EXIT_PENDING_APPROVAL: Final = 5
#: The ErrorInfo reason of a held call whose answer cannot say so itself.
_APPROVAL_REQUIRED: Final = "APPROVAL_REQUIRED"

_UNREACHABLE: Final = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

Answer = TypeVar("Answer")


class UnknownOutcome(Exception):
    """A create whose answer never came (UNAVAILABLE, DEADLINE_EXCEEDED): it may have been
    done. Sent again with the same request id, it answers what it did, and does it at most
    once (AIP-155) — so the error names that id."""

    def __init__(
        self, error: grpc.aio.AioRpcError, request_id: str, secret_hint: str | None = None
    ) -> None:
        super().__init__(request_id)
        self.error = error
        self.request_id = request_id
        self.secret_hint = secret_hint


async def sent_once(
    call: Awaitable[Answer], request_id: str, *, secret_hint: str | None = None
) -> Answer:
    """Await a create that carries ``request_id``; an unknown outcome names the id. A
    create that hands out a secret shows it only in its first answer, which a repeat
    cannot show again: ``secret_hint`` says what to do instead."""
    try:
        return await call
    except grpc.aio.AioRpcError as error:
        if error.code() in _UNREACHABLE:
            raise UnknownOutcome(error, request_id, secret_hint) from error
        raise


def report_unknown_outcome(unknown: UnknownOutcome, err: TextIO) -> int:
    code = report_rpc_error(unknown.error, err)
    if unknown.secret_hint is not None:
        print(
            "  (it may have been done, and its secret is shown only in the answer that was"
            f" lost: {unknown.secret_hint})",
            file=err,
        )
        return code
    print(
        f"  (it may have been done: the same command with --request-id {unknown.request_id}"
        " answers what it did, and does it at most once)",
        file=err,
    )
    return code


class RunNotSucceeded(Exception):
    """A watched Run ended otherwise than `succeeded` (its last Event's type says how)."""


class PendingApproval(Exception):
    """The call was held as an approval request (its id is the exception's argument):
    answered, but nothing was done yet."""

    def __init__(self, approval_id: str) -> None:
        super().__init__(approval_id)
        self.approval_id = approval_id


def report_pending_approval(pending: PendingApproval, err: TextIO) -> int:
    print(_held_for(pending.approval_id), file=err)
    return EXIT_PENDING_APPROVAL


def _held_for(approval_id: str) -> str:
    return (
        f"held for approval {approval_id or '(no id)'}: nothing was done yet; a person "
        f"decides it with `qinglong approval approve|deny {approval_id}`"
    )


class ConfigurationError(Exception):
    """A local problem the user can fix (the message says which file and what)."""


class NotFoundError(Exception):
    """A name the user gave matches nothing the server listed (a principal's name, looked
    up by the CLI before the call that needs its id): a refusal, like the server's own."""


def report_rpc_error(error: grpc.aio.AioRpcError, err: TextIO) -> int:
    """Print a failed call for a person; return the exit code it means."""
    code = error.code()
    reason = error_reason_of(error)
    line = f"error: {code.name}"
    if reason and reason != code.name:  # ALREADY_EXISTS is a code and a reason both
        line += f" {reason}"
    details = error.details()
    if details:
        line += f": {details}"
    print(line, file=err)
    for field, description in field_violations_of(error):
        print(f"  {field or '(request)'}: {description}", file=err)
    if reason == _APPROVAL_REQUIRED:
        print(f"  {_held_for(_approval_id_of(error))}", file=err)
        return EXIT_PENDING_APPROVAL
    if code in _UNREACHABLE:
        print(
            "  (ingress is unreachable or busy: is `qinglong up` running, or is --address right?)",
            file=err,
        )
        return EXIT_UNAVAILABLE
    return EXIT_REFUSED


def _approval_id_of(error: grpc.aio.AioRpcError) -> str:
    info = error_info_of(error)
    return "" if info is None else str(info.metadata.get(APPROVAL_ID, ""))


def report_configuration_error(error: ConfigurationError, err: TextIO) -> int:
    print(f"error: {error}", file=err)
    return EXIT_USAGE


def report_not_found(error: NotFoundError, err: TextIO) -> int:
    print(f"error: {grpc.StatusCode.NOT_FOUND.name}: {error}", file=err)
    return EXIT_REFUSED
