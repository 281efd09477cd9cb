"""The one rule by which ingress and control answer a failure of their database.

Both services talk to PostgreSQL and neither may import the other; this package stays
free of psycopg (Workers install it). So each service reads three facts off the driver's
exception — its SQLSTATE, the constraint it names, and whether the driver raised it as a
PEP 249 ``OperationalError`` — into a :class:`StorageFailure`, and this module decides what
they mean for the caller, by SQLSTATE class (PostgreSQL, Appendix A "Error Codes"):

========================================================  ===============================
what failed                                               answer
========================================================  ===============================
08 connection, 40 transaction rollback (serialization,    UNAVAILABLE: the database could
deadlock), 53 insufficient resources, 57 operator         not do it now, and a retry may
intervention (statement timeout, shutdown), 58 system     well succeed (the only code
error, 55P03 lock not available, 25006 read-only          clients retry, AIP-194)
transaction; and no SQLSTATE at all from an
OperationalError (refused or lost connection, pool
timeout)
23 integrity constraint violation                         the service's typed refusal for
                                                          that constraint name; a name it
                                                          does not know is INTERNAL
22 data exception                                         FIELD_INVALID naming the request
                                                          (validation missed a bound)
anything else (SQL, grants, schema: our own faults)       INTERNAL
========================================================  ===============================

Every answer but a mapped constraint is logged here, by SQLSTATE and exception class; a
caller never sees the driver's message, which can carry SQL, values, hosts and role names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from qinglong.rpc.v1.error_reason_pb2 import ErrorReason

from qinglong_protocol.errors import TypedStatus

_log = logging.getLogger(__name__)

#: SQLSTATE classes (the first two characters) whose failures are transient.
_UNAVAILABLE_CLASSES: Final = frozenset({"08", "40", "53", "57", "58"})
#: Single conditions of otherwise non-transient classes that are transient too.
#: 25006 read_only_sql_transaction: the server takes no writes now -- a managed service
#: or an operator set ``default_transaction_read_only`` (a full disk, maintenance), or a
#: standby was reached without ``target_session_attrs=read-write``. The deployment's
#: state, not the request's: the caller may try again once it is writable.
_UNAVAILABLE_STATES: Final = frozenset({"55P03", "25006"})  # lock_not_available, read-only
_INTEGRITY_CLASS: Final = "23"
_DATA_CLASS: Final = "22"


class Verdict(StrEnum):
    """What a storage failure means, before a service turns it into an answer."""

    UNAVAILABLE = "unavailable"
    CONSTRAINT = "constraint"
    DATA = "data"
    INTERNAL = "internal"


@dataclass(frozen=True)
class StorageFailure:
    """The facts of one driver exception that decide its answer (never its message)."""

    sqlstate: str | None
    constraint: str | None = None
    operational: bool = False
    """The driver raised it as a PEP 249 OperationalError (psycopg's pool timeouts too)."""
    error_type: str = ""
    """The exception's class name, for the log line only."""

    @property
    def verdict(self) -> Verdict:
        return classify(self.sqlstate, operational=self.operational)


def classify(sqlstate: str | None, *, operational: bool) -> Verdict:
    """The rule: by SQLSTATE class; without a SQLSTATE (the driver's own failure, no
    server answer), only an OperationalError is transient."""
    if sqlstate is None:
        return Verdict.UNAVAILABLE if operational else Verdict.INTERNAL
    if sqlstate[:2] in _UNAVAILABLE_CLASSES or sqlstate in _UNAVAILABLE_STATES:
        return Verdict.UNAVAILABLE
    if sqlstate[:2] == _INTEGRITY_CLASS:
        return Verdict.CONSTRAINT
    if sqlstate[:2] == _DATA_CLASS:
        return Verdict.DATA
    return Verdict.INTERNAL


def storage_answer(
    failure: StorageFailure,
    *,
    request_name: str,
    unavailable: ErrorReason.ValueType = ErrorReason.ERROR_REASON_STORAGE_UNAVAILABLE,
    error: BaseException | None = None,
) -> TypedStatus:
    """The answer to ``failure``, for every verdict but a constraint the service mapped
    itself (it asks first: constraint names are its schema knowledge).

    ``request_name`` (the public request's full name) is the field a data exception
    names, since the driver cannot say which value it was; ``unavailable`` is the reason
    of a transient failure (ingress's audit answers AUDIT_UNAVAILABLE); ``error`` lends its
    traceback to the log line of an INTERNAL answer.
    """
    verdict = failure.verdict
    if verdict is Verdict.UNAVAILABLE:
        _log.warning("storage unavailable: %s (SQLSTATE %s)", failure.error_type, failure.sqlstate)
        return TypedStatus(unavailable, "storage unavailable")
    if verdict is Verdict.DATA:
        # A value the database cannot represent (out of range, NUL in text): the request
        # was invalid and validation missed it; the log names the SQLSTATE to look for.
        _log.error(
            "storage refused a request value that validation let through: %s (SQLSTATE %s)",
            failure.error_type,
            failure.sqlstate,
        )
        return TypedStatus(
            ErrorReason.ERROR_REASON_FIELD_INVALID,
            "a request value is out of range",
            ((request_name or "request", "a value is outside what this server can store"),),
        )
    if verdict is Verdict.CONSTRAINT:
        _log.error(
            "constraint %s refused a write and no refusal is mapped to it (SQLSTATE %s)",
            failure.constraint,
            failure.sqlstate,
        )
    else:
        # The traceback is for operators; the caller gets nothing of it.
        _log.error(
            "storage failed: %s (SQLSTATE %s)",
            failure.error_type,
            failure.sqlstate,
            exc_info=error,
        )
    return TypedStatus(ErrorReason.ERROR_REASON_INTERNAL, "internal error")
