"""Wrapping a gRPC method handler's behaviour, whatever the method's shape.

Control's server interceptors (the caller check in server.py, the error interceptor in
errors.py, the contract's rules in contract_bounds.py) each put something around the
behaviour of the methods they cover: :class:`WrappingInterceptor` is their one shape.
A behaviour may be a coroutine (real servicers), an async generator (streaming
servicers) or a plain function (the generated base servicers); these helpers take all of
them, so an interceptor writes its unary and its streaming wrapper once.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import grpc

Behaviour = Callable[[Any, Any], Any]
#: Only the type stubs make RpcMethodHandler generic: a string, never evaluated.
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
#: Around a behaviour whose answer is one message: (behaviour, request, context) -> answer.
AroundUnary = Callable[[Behaviour, Any, Any], Awaitable[Any]]
#: Around a behaviour whose answer is a stream: (behaviour, request, context) -> messages.
AroundStream = Callable[[Behaviour, Any, Any], AsyncIterator[Any]]


def rewrapped(
    handler: grpc.RpcMethodHandler[Any, Any], unary: AroundUnary, stream: AroundStream
) -> grpc.RpcMethodHandler[Any, Any]:
    """The same handler with ``unary`` or ``stream`` around its behaviour. The request
    passed on is the message, or the request iterator of a client-streaming method."""
    deserializer, serializer = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary is not None:
        unary_unary = handler.unary_unary

        async def around_unary_unary(request: Any, context: Any) -> Any:
            return await unary(unary_unary, request, context)

        return grpc.unary_unary_rpc_method_handler(around_unary_unary, deserializer, serializer)
    if handler.stream_unary is not None:
        stream_unary = handler.stream_unary

        async def around_stream_unary(requests: Any, context: Any) -> Any:
            return await unary(stream_unary, requests, context)

        return grpc.stream_unary_rpc_method_handler(around_stream_unary, deserializer, serializer)
    if handler.unary_stream is not None:
        unary_stream = handler.unary_stream

        async def around_unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            async for response in stream(unary_stream, request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(around_unary_stream, deserializer, serializer)
    if handler.stream_stream is not None:
        stream_stream = handler.stream_stream

        async def around_stream_stream(requests: Any, context: Any) -> AsyncIterator[Any]:
            async for response in stream(stream_stream, requests, context):
                yield response

        return grpc.stream_stream_rpc_method_handler(around_stream_stream, deserializer, serializer)
    raise TypeError(f"RPC method handler with no behaviour: {handler!r}")


async def resolved(result: Any) -> Any:
    """A unary behaviour's answer: generated base servicers are plain functions."""
    return await result if inspect.isawaitable(result) else result


async def responses(result: Any) -> AsyncIterator[Any]:
    """A streaming behaviour's messages: it is an async generator, a coroutine that
    writes through ``context.write``, or (base servicers) a plain function."""
    if inspect.isasyncgen(result):
        async for response in result:
            yield response
    elif inspect.isawaitable(result):
        await result
    elif result is not None:
        for response in result:
            yield response


class WrappingInterceptor(grpc.aio.ServerInterceptor, ABC):
    """A server interceptor that wraps the handler of every method it :meth:`covers`
    (see :func:`rewrapped`) and passes every other call through untouched.

    grpc.aio asks the interceptors for a handler on every call; a method's wrapped
    handler is built once and kept for as long as the handler beneath is the same
    object (the registered servicer's, or a caching interceptor's below this one)."""

    @abstractmethod
    def covers(self, method: str) -> bool:
        """Whether the full method name (``/package.Service/Method``) is wrapped."""

    @abstractmethod
    def wrap(
        self, handler: grpc.RpcMethodHandler[Any, Any], method: str
    ) -> grpc.RpcMethodHandler[Any, Any]:
        """The covered method's handler, with this interceptor's work around it."""

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not self.covers(method):
            return handler
        cache: dict[str, tuple[Handler, Handler]] = self.__dict__.setdefault("_wrapped", {})
        kept = cache.get(method)
        if kept is not None and kept[0] is handler:
            return kept[1]
        wrapped = self.wrap(handler, method)
        cache[method] = (handler, wrapped)
        return wrapped
