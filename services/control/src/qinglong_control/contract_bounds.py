"""The contract's field rules, enforced again on what ingress forwards.

Ingress refuses an out-of-bounds request before it forwards anything; control holds the
runtime role, so it does not take that on trust and evaluates the same ``buf.validate``
declarations (qinglong_protocol.request_bounds) on the public request inside every
RuntimeService call before a servicer parses it. The servicer and ``wire.py`` therefore
convert values and never re-check a bound: there is no second copy of any rule here.
A refusal is raised as :class:`Refused`, so the error interceptor answers it like any
other (INVALID_ARGUMENT with a BadRequest naming the field, never the value).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong_protocol.request_bounds import primary_reason, request_violations, require_rules

from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.wrapping import (
    Behaviour,
    WrappingInterceptor,
    resolved,
    responses,
    rewrapped,
)

#: Each RuntimeService request carries the public request ingress admitted in this field.
PUBLIC_REQUEST_FIELD: Final = "request"


def public_request_types(service: ServiceDescriptor) -> dict[str, Any]:
    """Full method name -> the descriptor of the public request each method carries."""
    found = {}
    for method in service.methods:
        field = method.input_type.fields_by_name.get(PUBLIC_REQUEST_FIELD)
        if field is None or field.message_type is None:
            raise RuntimeError(f"{method.full_name} carries no public request")
        found[f"/{service.full_name}/{method.name}"] = field.message_type
    return found


def check_public_request(request: Any) -> None:
    """Refuse the call if the public request it carries breaks a rule of the contract."""
    violations = request_violations(getattr(request, PUBLIC_REQUEST_FIELD))
    if violations:
        first = violations[0]
        reason = ErrorReason.Name(primary_reason(violations)).removeprefix("ERROR_REASON_")
        raise Refused(Reason(reason), f"{first.field}: {first.description}", field=first.field)


class ContractBoundsInterceptor(WrappingInterceptor):
    """Runs :func:`check_public_request` before every method of ``service``."""

    def __init__(self, service: ServiceDescriptor) -> None:
        request_types = public_request_types(service)
        self._methods = frozenset(request_types)
        # Fail at start-up, not on a call, if a forwarded request type declares no rules.
        require_rules(request_types.values())

    def covers(self, method: str) -> bool:
        return method in self._methods

    def wrap(
        self, handler: grpc.RpcMethodHandler[Any, Any], method: str
    ) -> grpc.RpcMethodHandler[Any, Any]:
        return rewrapped(handler, _checked_unary, _checked_stream)


async def _checked_unary(behaviour: Behaviour, request: Any, context: Any) -> Any:
    check_public_request(request)
    return await resolved(behaviour(request, context))


async def _checked_stream(behaviour: Behaviour, request: Any, context: Any) -> AsyncIterator[Any]:
    check_public_request(request)
    async for response in responses(behaviour(request, context)):
        yield response
