"""gRPC method handlers for every public route, all served by the one gateway pipeline."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, cast

import grpc
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import DecodeError, Message
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong_protocol.errors import abort_with, status_for
from qinglong_protocol.metrics import outcome_of_code

from qinglong_ingress.gateway import Gateway
from qinglong_ingress.metrics import CALL_DURATION
from qinglong_ingress.routes import ROUTES, Route
from qinglong_ingress.stages import Context, Received
from qinglong_ingress.validation import REQUEST_BYTE_CAPS, undecodable_violation

_log = logging.getLogger(__name__)


def _parser(route: Route) -> Callable[[bytes], Received]:
    """Keep the size as received (a parsed message can be much smaller than its bytes)
    and turn unparseable bytes into a refusal the gateway audits, not a transport error:
    an exception escaping a deserializer would reach the caller as INTERNAL."""
    # The stubs type DESCRIPTOR as the pure-Python or the upb class; both have this API.
    descriptor = cast(Descriptor, route.request_type.DESCRIPTOR)

    cap = REQUEST_BYTE_CAPS.get(route.full_method)

    def parse(raw: bytes) -> Received:
        if cap is not None and len(raw) > cap:
            # Bounds before work: bytes over the method's cap are not even parsed; the
            # size stage refuses them (the listener's limit is the largest method's cap).
            return Received(None, len(raw))
        try:
            return Received(route.request_type.FromString(raw), len(raw))
        except DecodeError:
            return Received(None, len(raw), undecodable_violation(descriptor, raw))
        except Exception:  # any other parser failure is still a malformed request
            _log.warning("request of %s did not parse", descriptor.full_name, exc_info=True)
            return Received(None, len(raw), undecodable_violation(descriptor, raw))

    return parse


async def _internal(context: Context, error: Exception) -> None:
    """An unexpected fault leaves as a generic INTERNAL: grpc.aio would otherwise send
    the exception's text (hosts, roles, SQL) to the caller as UNKNOWN."""
    _log.error("internal error in ingress", exc_info=error)
    await abort_with(context, status_for(ErrorReason.ERROR_REASON_INTERNAL, "internal error"))


def _timed(route: Route, context: Context, started: float, cancelled: bool = False) -> None:
    """Record the call's latency by method and the code it was answered with."""
    code = context.code()
    outcome = "cancelled" if cancelled else outcome_of_code(None if code is None else code.name)
    CALL_DURATION.labels(route.name, outcome).observe(time.perf_counter() - started)


def _unary(gateway: Gateway, route: Route) -> grpc.RpcMethodHandler[Any, Any]:
    async def behaviour(request: Received, context: Context) -> Message:
        started = time.perf_counter()
        cancelled = False
        try:
            return await gateway.unary(route, request, context)
        except asyncio.CancelledError:
            cancelled = True
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # any other fault: generic, never its text
            await _internal(context, error)
            raise
        finally:
            _timed(route, context, started, cancelled)

    return grpc.unary_unary_rpc_method_handler(
        behaviour,
        request_deserializer=_parser(route),
        response_serializer=route.response_type.SerializeToString,
    )


def _server_stream(gateway: Gateway, route: Route) -> grpc.RpcMethodHandler[Any, Any]:
    async def behaviour(request: Received, context: Context) -> AsyncIterator[Message]:
        started = time.perf_counter()
        cancelled = False
        try:
            async for response in gateway.server_stream(route, request, context):
                yield response
        except asyncio.CancelledError:
            cancelled = True
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # any other fault: generic, never its text
            await _internal(context, error)
            raise
        finally:
            _timed(route, context, started, cancelled)

    return grpc.unary_stream_rpc_method_handler(
        behaviour,
        request_deserializer=_parser(route),
        response_serializer=route.response_type.SerializeToString,
    )


def public_handlers(
    gateway: Gateway, routes: Sequence[Route] = ROUTES
) -> list[grpc.GenericRpcHandler]:
    """Handlers of ``routes`` (the public listener's by default; the enrollment listener
    passes ENROLLMENT_ROUTES), each going through ``gateway``."""
    by_service: dict[str, dict[str, grpc.RpcMethodHandler[Any, Any]]] = defaultdict(dict)
    for route in routes:
        make = _server_stream if route.server_streaming else _unary
        by_service[route.service][route.name] = make(gateway, route)
    return [
        grpc.method_handlers_generic_handler(service, methods)
        for service, methods in by_service.items()
    ]
