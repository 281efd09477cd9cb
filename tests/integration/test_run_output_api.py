"""Run output through ingress (R-OPS-1), real gRPC over mutual TLS: a Worker appends
chunks of an Attempt's output, operators page through it; bad input and foreign callers
get typed errors, are audited, and change nothing."""

from __future__ import annotations

import grpc
import psycopg
from qinglong.control.v1 import run_service_pb2, run_service_pb2_grpc
from qinglong.rpc.v1 import fence_pb2
from qinglong.worker.v1 import worker_service_pb2, worker_service_pb2_grpc
from qinglong_protocol import bounds
from qinglong_protocol.errors import error_info_of, error_reason_of, field_violations_of

from tests.support.calls import failure
from tests.support.stack import PROJECT, Stack, bearer
from tests.support.worker_steps import open_session, running_attempt

ws = worker_service_pb2
rs = run_service_pb2
CHUNK = bounds.OUTPUT_CHUNK_MAX_BYTES


def stored_rows(stack: Stack, attempt_id: str) -> list[tuple[int, int]]:
    with psycopg.connect(stack.database.urls.migration) as conn:
        rows = conn.execute(
            "SELECT start_offset, end_offset FROM qinglong.attempt_output_chunks"
            " WHERE attempt_id = %s ORDER BY start_offset",
            (attempt_id,),
        ).fetchall()
    return [(row[0], row[1]) for row in rows]


async def test_a_worker_appends_and_an_operator_pages_through_the_output(stack: Stack) -> None:
    output = bytes(range(256)) * 600  # 153,600 bytes: three chunks, any byte value
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        fence = await running_attempt(stack, worker)
        for start in range(0, len(output), CHUNK):
            answer = await worker.AppendOutput(
                ws.AppendOutputRequest(fence=fence, offset=start, data=output[start:][:CHUNK])
            )
            assert (answer.end_offset, answer.replayed) == (min(start + CHUNK, len(output)), False)
        # The last chunk again, as after a lost answer: a replay, not an error.
        again = await worker.AppendOutput(
            ws.AppendOutputRequest(fence=fence, offset=2 * CHUNK, data=output[2 * CHUNK :])
        )
        assert (again.end_offset, again.replayed) == (len(output), True)
    assert stored_rows(stack, fence.attempt_id) == [
        (0, CHUNK),
        (CHUNK, 2 * CHUNK),
        (2 * CHUNK, len(output)),
    ]

    async with stack.channel(stack.operator_identity("ops")) as channel:
        runs = run_service_pb2_grpc.RunServiceStub(channel)
        read, offset = b"", 0
        while True:  # a viewer may read: the permission is `read`
            page = await runs.ReadRunOutput(
                rs.ReadRunOutputRequest(
                    project_id=PROJECT, run_id=fence.run_id, offset=offset, max_bytes=50_000
                ),
                metadata=bearer(stack, "vera"),
            )
            assert page.offset == offset
            assert len(page.data) <= 50_000
            read += page.data
            offset = page.next_offset
            if offset == page.end_offset:
                break
        assert read == output
        assert (page.attempt_number, page.attempt_id) == (1, fence.attempt_id)
        assert (page.complete, page.run_terminal) == (False, False)
        first = await runs.ReadRunOutput(
            rs.ReadRunOutputRequest(project_id=PROJECT, run_id=fence.run_id, attempt_number=1),
            metadata=bearer(stack, "alice"),
        )
        assert first.data == output[: bounds.OUTPUT_READ_DEFAULT_BYTES]
        # Where the latest Attempt stands, without its bytes (what `run logs --follow`
        # asks while it waits): an offset past any end.
        where = await runs.ReadRunOutput(
            rs.ReadRunOutputRequest(
                project_id=PROJECT, run_id=fence.run_id, offset=bounds.MAX_SAFE_INTEGER, max_bytes=1
            ),
            metadata=bearer(stack, "vera"),
        )
        assert (where.attempt_number, where.end_offset, where.data) == (1, len(output), b"")
        assert (where.complete, where.run_terminal) == (False, False)
        absent = await failure(
            runs.ReadRunOutput(
                rs.ReadRunOutputRequest(project_id=PROJECT, run_id=fence.run_id, attempt_number=2),
                metadata=bearer(stack, "alice"),
            )
        )
        assert (absent.code(), error_reason_of(absent)) == (
            grpc.StatusCode.NOT_FOUND,
            "ATTEMPT_NOT_FOUND",
        )
        # No role in the project: refused by ingress, never forwarded.
        forwarded = list(stack.control_calls.methods)
        outsider = await failure(
            runs.ReadRunOutput(
                rs.ReadRunOutputRequest(project_id=PROJECT, run_id=fence.run_id),
                metadata=bearer(stack, "mallory"),
            )
        )
        assert (outsider.code(), error_reason_of(outsider)) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "PERMISSION_DENIED",
        )
        assert stack.control_calls.methods == forwarded
    audited = [(row["operation"], row["outcome"]) for row in stack.audit_rows()]
    assert audited.count(("WorkerService/AppendOutput", "admitted")) == 4
    assert ("RunService/ReadRunOutput", "permission_denied") in audited


async def test_bad_chunks_get_typed_errors_and_change_nothing(stack: Stack) -> None:
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        fence = await running_attempt(stack, worker)
        await worker.AppendOutput(ws.AppendOutputRequest(fence=fence, offset=0, data=b"0123456789"))

        gap = await failure(
            worker.AppendOutput(ws.AppendOutputRequest(fence=fence, offset=11, data=b"x"))
        )
        info = error_info_of(gap)
        assert info is not None
        assert (gap.code(), info.reason, dict(info.metadata)) == (
            grpc.StatusCode.ABORTED,
            "OUTPUT_OFFSET_GAP",
            {"expectedOffset": "10"},
        )
        conflict = await failure(
            worker.AppendOutput(ws.AppendOutputRequest(fence=fence, offset=5, data=b"5X"))
        )
        assert (conflict.code(), error_reason_of(conflict)) == (
            grpc.StatusCode.ABORTED,
            "REPLAY_MISMATCH",
        )
        forwarded = list(stack.control_calls.methods)
        too_big = await failure(
            worker.AppendOutput(
                ws.AppendOutputRequest(fence=fence, offset=10, data=b"a" * (CHUNK + 1))
            )
        )
        assert (too_big.code(), error_reason_of(too_big)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "FIELD_INVALID",
        )
        assert [field for field, _ in field_violations_of(too_big)] == ["data"]
        empty = await failure(worker.AppendOutput(ws.AppendOutputRequest(fence=fence, offset=10)))
        assert [field for field, _ in field_violations_of(empty)] == ["data"]
        assert stack.control_calls.methods == forwarded  # refused by ingress
        # The lease capability is never echoed in a refusal.
        for refusal in (gap, conflict, too_big, empty):
            assert fence.lease_token not in (refusal.details() or "")

    async with stack.channel(stack.worker_identity("worker-b")) as channel:
        other = worker_service_pb2_grpc.WorkerServiceStub(channel)
        # worker-b speaking for worker-a: refused by ingress (the certificate's worker).
        impostor = await failure(
            other.AppendOutput(ws.AppendOutputRequest(fence=fence, offset=10, data=b"!"))
        )
        assert (impostor.code(), error_reason_of(impostor)) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "PRINCIPAL_MISMATCH",
        )
        # worker-b with its own session, naming worker-a's Attempt: fenced by control.
        session = await open_session(other, "worker-b")
        theirs = fence_pb2.Fence()
        theirs.CopyFrom(fence)
        theirs.worker_id = "worker-b"
        theirs.session_id = session.session_id
        theirs.worker_generation = session.worker_generation
        fenced = await failure(
            other.AppendOutput(ws.AppendOutputRequest(fence=theirs, offset=10, data=b"!"))
        )
        assert (fenced.code(), error_reason_of(fenced)) == (
            grpc.StatusCode.ABORTED,
            "FENCE_MISMATCH",
        )
    assert stored_rows(stack, fence.attempt_id) == [(0, 10)]
    with psycopg.connect(stack.database.urls.migration) as conn:
        audit_text = str(conn.execute("SELECT * FROM qinglong.security_audit").fetchall())
    assert fence.lease_token not in audit_text
