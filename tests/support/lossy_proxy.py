"""A lossy loopback proxy between one Worker and ingress, for fault tests.

It is a real gRPC server on 127.0.0.1 that relays every unary call as raw bytes (no
message types are known here), so it works for every Worker command, present or future.
TLS is real on both sides:

* downstream it presents the ingress *server* certificate of the dev PKI (which names
  127.0.0.1), so the Worker's ordinary CA trust and host name check pass, and it requires
  a client certificate from the same CA and refuses any identity but the one Worker it
  stands in for;
* upstream it presents that Worker's own client certificate, because ingress binds the
  mTLS identity to the worker id named in each request: one proxy per Worker identity.

A proxy for a machine that has no certificate yet (a join, to ingress's enrollment
listener) takes neither: it requires no client certificate and presents none.

A :class:`FaultSchedule` decides per call, by method and per-method call number, whether
to inject a fault at one of two points:

* ``Phase.REQUEST`` -- before forwarding: ingress never sees the call;
* ``Phase.ANSWER`` -- after ingress answered OK (so control has committed): the answer
  is thrown away and the Worker gets ``UNAVAILABLE`` instead. That is a lost answer.

A rule may also run an action at its point (e.g. ``kill -9`` the Worker), which is how a
crash at an exact step of a Run is staged. Refusals from ingress pass through unchanged,
ErrorInfo details included. The proxy counts calls and faults per method.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final, NoReturn

import grpc
from qinglong_protocol.tls import (
    TlsFiles,
    mutual_tls_channel_credentials,
    mutual_tls_server_credentials,
    peer_uris,
)

LOOPBACK: Final = "127.0.0.1"
#: Used when the Worker sent no deadline; the Worker always sends one today.
_DEFAULT_UPSTREAM_TIMEOUT_SECONDS: Final = 10.0
_START_TIMEOUT_SECONDS: Final = 10.0
_STOP_TIMEOUT_SECONDS: Final = 10.0


class Phase(StrEnum):
    REQUEST = "request"
    """Before forwarding: the request is lost on its way to ingress."""
    ANSWER = "answer"
    """After ingress answered OK: the committed answer is lost on its way back."""


@dataclass
class Rule:
    """One fault: where (method, phase), which calls, and what else happens then."""

    method: str
    """The short method name, e.g. ``ControlLease``."""
    phase: Phase
    select: Callable[[int], bool]
    """Given the number of the candidate call (1-based, counted by this rule), fire?"""
    description: str
    action: Callable[[], None] | None = None
    """Runs at the fault point, before the Worker's call fails (e.g. kill -9 the Worker)."""
    answer_matches: Callable[[bytes], bool] | None = None
    """``ANSWER`` only: count a call as a candidate only if its answer matches."""
    candidates: int = field(default=0, init=False)

    def consider(self, method: str, phase: Phase, answer: bytes | None) -> bool:
        if method != self.method or phase is not self.phase:
            return False
        if self.answer_matches is not None and (answer is None or not self.answer_matches(answer)):
            return False
        self.candidates += 1
        return self.select(self.candidates)


def numbers(*wanted: int) -> Callable[[int], bool]:
    chosen = frozenset(wanted)
    return lambda number: number in chosen


def every(nth: int) -> Callable[[int], bool]:
    return lambda number: number % nth == 0


def lose_answers(method: str, *which: int, matches: Callable[[bytes], bool] | None = None) -> Rule:
    """Lose the answers of the given candidate calls of `method` (1-based)."""
    return Rule(
        method,
        Phase.ANSWER,
        numbers(*which),
        f"lose {method} answer(s) {list(which)}",
        answer_matches=matches,
    )


def lose_every_nth_answer(method: str, nth: int) -> Rule:
    return Rule(method, Phase.ANSWER, every(nth), f"lose every {nth}th {method} answer")


def act_at(
    method: str,
    phase: Phase,
    action: Callable[[], None],
    *,
    call: int = 1,
    matches: Callable[[bytes], bool] | None = None,
) -> Rule:
    """At the `call`-th candidate `method` call, run `action` at `phase`; that call is
    lost too (its request, or its committed answer)."""
    return Rule(
        method,
        phase,
        numbers(call),
        f"{method} #{call} {phase}: act",
        action=action,
        answer_matches=matches,
    )


@dataclass(frozen=True)
class Injected:
    method: str
    number: int
    """The call's number among all calls of `method` through this proxy."""
    phase: Phase
    description: str


class FaultSchedule:
    """The rules, and a thread-safe record of what reached the proxy and what was injected."""

    def __init__(self, rules: Iterable[Rule] = ()) -> None:
        self._rules = list(rules)
        self._lock = threading.Lock()
        self._calls: Counter[str] = Counter()
        self._injected: list[Injected] = []

    def add(self, rule: Rule) -> None:
        """Add a rule once its action can be named (e.g. the Worker it kills exists)."""
        with self._lock:
            self._rules.append(rule)

    def called(self, method: str) -> int:
        with self._lock:
            self._calls[method] += 1
            return self._calls[method]

    def decide(self, method: str, number: int, phase: Phase, answer: bytes | None) -> Rule | None:
        """The rule that fires for this call at this phase, if any. Every rule counts its
        candidates, so overlapping rules keep independent schedules."""
        with self._lock:
            fired = [rule for rule in self._rules if rule.consider(method, phase, answer)]
            if not fired:
                return None
            self._injected.append(Injected(method, number, phase, fired[0].description))
            return fired[0]

    @property
    def calls(self) -> Counter[str]:
        with self._lock:
            return Counter(self._calls)

    @property
    def faults(self) -> Counter[str]:
        with self._lock:
            return Counter(injected.method for injected in self._injected)

    @property
    def injected(self) -> list[Injected]:
        with self._lock:
            return list(self._injected)

    def summary(self) -> str:
        calls, faults = self.calls, self.faults
        return ", ".join(
            f"{method} {calls[method]}/{faults[method]}" for method in sorted(calls | faults)
        )


class _RawRelay(grpc.GenericRpcHandler):
    """Hands every method to the proxy as bytes in, bytes out."""

    def __init__(self, proxy: LossyProxy) -> None:
        self._proxy = proxy

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[bytes, bytes]:
        method: str = handler_call_details.method

        async def relay(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
            return await self._proxy.relay(method, request, context)

        # No (de)serializers: grpc passes the raw message bytes through.
        return grpc.unary_unary_rpc_method_handler(relay)


def _forwardable(key: str) -> bool:
    # Transport headers are the channel's own; everything else (trace context) travels on.
    return not key.startswith((":", "grpc-")) and key not in ("user-agent", "content-type")


class LossyProxy:
    """Start with :meth:`start` (or ``with``); it serves on its own thread and event loop,
    so tests stay plain blocking code around real subprocesses."""

    def __init__(
        self,
        *,
        upstream_address: str,
        upstream_identity: TlsFiles | None,
        server_identity: TlsFiles,
        allowed_peer_uri: str | None,
        schedule: FaultSchedule | None = None,
    ) -> None:
        self.schedule = schedule or FaultSchedule()
        self._upstream_address = upstream_address
        self._upstream_identity = upstream_identity
        self._server_identity = server_identity
        self._allowed_peer_uri = allowed_peer_uri
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._channel: grpc.aio.Channel | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def __enter__(self) -> LossyProxy:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> str:
        self._thread = threading.Thread(target=self._run, name="lossy-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_SECONDS):
            raise RuntimeError("the lossy proxy did not start")
        if self._failure is not None:
            raise RuntimeError("the lossy proxy failed to start") from self._failure
        return self.address

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(_STOP_TIMEOUT_SECONDS)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as error:
            self._failure = error
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        anonymous = self._upstream_identity is None
        upstream = (
            grpc.ssl_channel_credentials(self._server_identity.ca_cert.read_bytes())
            if self._upstream_identity is None
            else mutual_tls_channel_credentials(self._upstream_identity)
        )
        self._channel = grpc.aio.secure_channel(self._upstream_address, upstream)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_RawRelay(self),))
        self.port = server.add_secure_port(
            f"{LOOPBACK}:0",
            mutual_tls_server_credentials(self._server_identity, require_client_auth=not anonymous),
        )
        await server.start()
        self._ready.set()
        try:
            await self._stopping.wait()
        finally:
            await server.stop(None)
            await self._channel.close()

    async def relay(
        self, method: str, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        allowed = self._allowed_peer_uri
        if allowed is not None and allowed not in peer_uris(context.auth_context()):
            # Never relay someone else's call under the Worker's identity.
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not the proxied Worker")
        name = method.rsplit("/", 1)[-1]
        number = self.schedule.called(name)
        rule = self.schedule.decide(name, number, Phase.REQUEST, None)
        if rule is not None:
            await self._fail(rule, context, "request lost")
        assert self._channel is not None
        upstream: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = self._channel.unary_unary(method)
        remaining = context.time_remaining()
        metadata = tuple(
            (key, value)
            for key, value in (context.invocation_metadata() or ())
            if _forwardable(key)
        )
        try:
            answer: bytes = await upstream(
                request,
                timeout=_DEFAULT_UPSTREAM_TIMEOUT_SECONDS if remaining is None else remaining,
                metadata=metadata,
            )
        except grpc.aio.AioRpcError as refused:
            # The real refusal, with its status details (ErrorInfo, BadRequest) intact.
            trailing: Sequence[tuple[str, Any]] = tuple(refused.trailing_metadata() or ())
            await context.abort(refused.code(), refused.details() or "", trailing)
        rule = self.schedule.decide(name, number, Phase.ANSWER, answer)
        if rule is not None:
            await self._fail(rule, context, "answer lost")
        return answer

    async def _fail(
        self, rule: Rule, context: grpc.aio.ServicerContext[bytes, bytes], what: str
    ) -> NoReturn:
        if rule.action is not None:
            rule.action()
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"fault injected: {what}")
