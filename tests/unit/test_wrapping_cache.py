"""Control's interceptors build a method's wrapped handler once, not on every call."""

from __future__ import annotations

from typing import Any

import grpc
from qinglong_control.wrapping import WrappingInterceptor, rewrapped


class Counting(WrappingInterceptor):
    def __init__(self) -> None:
        self.built = 0

    def covers(self, method: str) -> bool:
        return method.startswith("/covered.")

    def wrap(
        self, handler: grpc.RpcMethodHandler[Any, Any], method: str
    ) -> grpc.RpcMethodHandler[Any, Any]:
        self.built += 1

        async def around(behaviour: Any, request: Any, context: Any) -> Any:
            return await behaviour(request, context)

        async def stream(behaviour: Any, request: Any, context: Any) -> Any:
            yield await behaviour(request, context)

        return rewrapped(handler, around, stream)


class Details:
    def __init__(self, method: str) -> None:
        self.method = method


async def _echo(request: Any, context: Any) -> Any:
    return request


async def test_a_method_is_wrapped_once_while_its_handler_stays_the_same() -> None:
    interceptor = Counting()
    registered = grpc.unary_unary_rpc_method_handler(_echo)
    replaced = grpc.unary_unary_rpc_method_handler(_echo)

    async def of(handler: Any) -> Any:
        return handler

    def ask(method: str, handler: Any) -> Any:
        return interceptor.intercept_service(lambda _: of(handler), Details(method))  # type: ignore[arg-type]

    first = await ask("/covered.S/M", registered)
    assert await ask("/covered.S/M", registered) is first
    assert interceptor.built == 1
    # Another handler beneath (say, an interceptor that does not cache): wrapped afresh.
    other = await ask("/covered.S/M", replaced)
    assert other is not first
    assert interceptor.built == 2
    # Not covered: passed through untouched, nothing built.
    assert await ask("/other.S/M", registered) is registered
    assert interceptor.built == 2
    assert await first.unary_unary("ping", None) == "ping"
