"""One place that turns what went wrong into a gRPC status with an ErrorInfo reason.

Refusals keep their low-cardinality reason; storage trouble is UNAVAILABLE (the only code
clients retry automatically, AIP-194); anything else is a generic INTERNAL with no detail,
logged here with its traceback so operators can see it and callers cannot.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import psycopg
import psycopg_pool
from opentelemetry import metrics
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong_protocol.errors import status_for

from qinglong_control.domain.refusals import Refused

_log = logging.getLogger(__name__)

COMMAND_DURATION = metrics.get_meter("qinglong.control").create_histogram(
    "qinglong.control.command.duration",
    unit="ms",
    description="Runtime command latency (one short transaction each), by method and outcome",
)

Response = TypeVar("Response")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Response]]


def wire_reason(refused: Refused) -> ErrorReason.ValueType:
    return ErrorReason.Value(f"ERROR_REASON_{refused.reason.value}")


async def abort_for(context: grpc.aio.ServicerContext[Any, Any], error: BaseException) -> None:
    if isinstance(error, Refused):
        await context.abort_with_status(
            status_for(wire_reason(error), error.detail or error.reason)
        )
    if isinstance(error, psycopg.OperationalError | psycopg_pool.PoolTimeout):
        _log.warning("storage unavailable: %s", type(error).__name__)
        await context.abort_with_status(
            status_for(ErrorReason.ERROR_REASON_STORAGE_UNAVAILABLE, "storage unavailable")
        )
    _log.error("internal error", exc_info=error)
    await context.abort_with_status(status_for(ErrorReason.ERROR_REASON_INTERNAL, "internal error"))


def translated(handler: Handler[Response]) -> Handler[Response]:
    """Wrap one servicer method so every failure leaves as a typed status."""

    method = handler.__name__

    @functools.wraps(handler)
    async def wrapper(
        self: Any, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Response:
        started = time.perf_counter()
        outcome = "ok"
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            outcome = "aborted"
            raise
        except Exception as error:  # every failure leaves as a typed status
            outcome = error.reason.value if isinstance(error, Refused) else type(error).__name__
            await abort_for(context, error)
            raise AssertionError("abort_for always aborts") from error
        finally:
            # Low-cardinality attributes only: run and attempt ids belong on spans.
            COMMAND_DURATION.record(
                (time.perf_counter() - started) * 1000.0,
                {"rpc.method": method, "outcome": outcome},
            )

    return wrapper
