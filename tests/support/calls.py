"""Awaiting a gRPC call that must fail, for tests that assert on the status it gets."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import grpc


async def failure(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    """The error a unary call ends with; the test fails if the call succeeds."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error
    raise AssertionError("the call succeeded")


async def stream_failure(stream: Any) -> grpc.aio.AioRpcError:
    """The error a server stream ends with; the test fails if the stream ends cleanly."""
    try:
        async for _ in stream:
            pass
    except grpc.aio.AioRpcError as error:
        return error
    raise AssertionError("the stream ended without an error")
