"""A control replica that dies without closing its connections (its node lost power): ingress
finds the dead connection by its pings and connects again, instead of sending every call
into it until the kernel gives up (about 15 minutes, past every Worker's lease).

The relay between ingress and control silences the connection that is open — it stays
open and passes nothing either way — while new connections pass, as a Service sends them
to a live replica."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
import pytest
from qinglong.control.v1 import run_service_pb2, run_service_pb2_grpc
from qinglong_protocol.keepalive import INTERNAL_KEEPALIVE_MS, INTERNAL_KEEPALIVE_TIMEOUT_MS

from tests.support.postgres import MigratedDatabase
from tests.support.stack import PROJECT, Stack, bearer, running_stack
from tests.support.tcp_relay import TcpRelay

CALL_TIMEOUT_SECONDS = 2.0
#: Found dead within one ping interval and its timeout; then a reconnect, with backoff.
RECOVERY_BOUND_SECONDS = (INTERNAL_KEEPALIVE_MS + INTERNAL_KEEPALIVE_TIMEOUT_MS) / 1000 + 10


@pytest.fixture
async def relayed() -> AsyncIterator[TcpRelay]:
    async with TcpRelay() as relay:
        yield relay


@pytest.fixture
async def stack(
    database_pg18: MigratedDatabase, tmp_path_factory: pytest.TempPathFactory, relayed: TcpRelay
) -> AsyncIterator[Stack]:
    async with running_stack(
        database_pg18, tmp_path_factory.mktemp("pki"), control_via=relayed.towards
    ) as running:
        yield running


async def test_ingress_leaves_a_silent_control_connection(stack: Stack, relayed: TcpRelay) -> None:
    async with stack.channel(stack.operator_identity("ops")) as channel:
        runs = run_service_pb2_grpc.RunServiceStub(channel)

        async def list_runs() -> grpc.StatusCode:
            try:
                await runs.ListRuns(
                    run_service_pb2.ListRunsRequest(project_id=PROJECT),
                    metadata=bearer(stack, "alice"),
                    timeout=CALL_TIMEOUT_SECONDS,
                )
            except grpc.aio.AioRpcError as error:
                return error.code()
            return grpc.StatusCode.OK

        assert await list_runs() is grpc.StatusCode.OK
        assert relayed.connections == 1
        assert relayed.silence() == 1

        silenced_at = time.monotonic()
        failed: list[grpc.StatusCode] = []
        while (code := await list_runs()) is not grpc.StatusCode.OK:
            failed.append(code)
            assert time.monotonic() - silenced_at < RECOVERY_BOUND_SECONDS, (
                f"still failing {RECOVERY_BOUND_SECONDS:.0f} s after control went silent: "
                f"{len(failed)} calls failed"
            )
        recovered_after = time.monotonic() - silenced_at
    print(
        f"silent control connection: {len(failed)} calls failed "
        f"({', '.join(sorted({code.name for code in failed}))}), answered again after "
        f"{recovered_after:.1f} s over connection {relayed.connections}"
    )
    # The calls in between ended at their deadline (nothing answered them), none of
    # them with an answer that was not control's.
    assert set(failed) <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE}
    assert relayed.connections >= 2
