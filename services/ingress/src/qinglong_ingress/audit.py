"""The outcome an audit row records, defined once for the code and the database.

`qinglong.security_audit.outcome` has a CHECK listing exactly these values (migrations
0001, 0005 and 0007); tests/contract/test_audit_outcome.py reads that CHECK from a
migrated database and compares, and AdminService's AuditOutcome enum (how an
administrator filters and reads them) is compared with this one too. A refusal's
outcome is the gRPC code its reason is sent with, so a refusal cannot be audited as
something other than what the caller is told.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Final

import grpc
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong_protocol.errors import code_for


class AuditOutcome(StrEnum):
    ADMITTED = "admitted"
    """Passed admission; forwarded to control with this row's id once the row was durable.
    One exception: a caller whose admission budget ran out while its batch was being
    written was answered UNAVAILABLE and not forwarded, though the batch may still have
    committed its row (its commit's answer came too late, or was lost with the
    connection). An `admitted` row without a matching call in control's records is that
    call; nothing was ever forwarded without its row."""
    REQUIRE_APPROVAL = "require_approval"
    """Answered by ingress: the caller's role needs an approval for this (R-CAN-2)."""
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    INVALID_ARGUMENT = "invalid_argument"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"
    RATE_LIMITED = "rate_limited"
    """Refused by a rate limit: the Worker enrollment listener's, or the public listener's
    on a certificate refused as unauthenticated again and again."""


#: The outcome of a refusal, by the code its reason is sent with.
_REFUSED_WITH: Final[Mapping[grpc.StatusCode, AuditOutcome]] = {
    grpc.StatusCode.UNAUTHENTICATED: AuditOutcome.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: AuditOutcome.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT: AuditOutcome.INVALID_ARGUMENT,
    grpc.StatusCode.UNAVAILABLE: AuditOutcome.UNAVAILABLE,
    grpc.StatusCode.INTERNAL: AuditOutcome.INTERNAL,
    grpc.StatusCode.RESOURCE_EXHAUSTED: AuditOutcome.RATE_LIMITED,
}


def refused_outcome(reason: ErrorReason.ValueType) -> AuditOutcome:
    """The outcome a refusal with ``reason`` is audited as. Ingress refuses only with
    reasons of these codes; any other is a fault of ingress (ValueError)."""
    code = code_for(reason)
    outcome = _REFUSED_WITH.get(code)
    if outcome is None:
        raise ValueError(f"ingress does not refuse with {code.name}")
    return outcome
