"""Exit codes of refusals as the CLI reports them: a call held for approval is not done."""

from __future__ import annotations

import io
import uuid

import grpc
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong_cli.cli_errors import EXIT_PENDING_APPROVAL, EXIT_REFUSED, report_rpc_error
from qinglong_protocol.errors import APPROVAL_ID, status_for


def _failed(status: grpc.Status) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        status.code,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*status.trailing_metadata),
        details=status.details,
    )


def test_a_call_held_for_approval_exits_5_naming_the_request() -> None:
    approval_id = str(uuid.uuid4())
    held = status_for(
        ErrorReason.ERROR_REASON_APPROVAL_REQUIRED,
        "this needs an approval",
        metadata={APPROVAL_ID: approval_id},
    )
    err = io.StringIO()
    assert report_rpc_error(_failed(held), err) == EXIT_PENDING_APPROVAL
    first, second = err.getvalue().splitlines()
    assert first.endswith("APPROVAL_REQUIRED: this needs an approval")
    assert second == (
        f"  held for approval {approval_id}: nothing was done yet; a person decides it with "
        f"`qinglong approval approve|deny {approval_id}`"
    )


def test_a_refusal_exits_1() -> None:
    denied = status_for(ErrorReason.ERROR_REASON_PERMISSION_DENIED, "no project role allows this")
    err = io.StringIO()
    assert report_rpc_error(_failed(denied), err) == EXIT_REFUSED
    assert "held for approval" not in err.getvalue()
