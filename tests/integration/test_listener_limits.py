"""What a caller may hold open on an ingress listener (listener_limits.py), tried for real:
calls whose request message never comes — held open by a client that sent the call's
headers only — over real TLS, against the enrollment listener's own server.

Without limits each such call held server memory for ever, unaudited and unseen by any
rate limit. Now more calls than the listener allows are refused at once, and those held
end with their connection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from qinglong_cli.pki import ensure_dev_pki
from qinglong_ingress.listener_limits import ENROLLMENT_LIMITS, PUBLIC_LIMITS, ListenerLimits
from qinglong_ingress.server import create_enrollment_server

METHOD = "/qinglong.test.Hang/Call"
#: Small enough to try in seconds; the shipped limits' shape is checked below.
LIMITS = ListenerLimits(
    max_concurrent_rpcs=6,
    max_concurrent_streams=2,
    max_connection_age_ms=1_000,
    max_connection_age_grace_ms=1_000,
    max_connection_idle_ms=10_000,
)
CONNECTIONS = 5


async def _echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return request


async def _never(ready: asyncio.Event) -> AsyncIterator[bytes]:
    await ready.wait()  # the call's headers went out; its message never does
    yield b""


async def test_calls_that_never_send_their_message_are_capped_and_end(tmp_path: Path) -> None:
    pki = ensure_dev_pki(tmp_path / "pki")
    handler = grpc.method_handlers_generic_handler(
        "qinglong.test.Hang", {"Call": grpc.unary_unary_rpc_method_handler(_echo)}
    )
    server, port = await create_enrollment_server(
        "127.0.0.1:0", pki.ingress_server, [handler], LIMITS
    )
    await server.start()
    credentials = grpc.ssl_channel_credentials(pki.ca_cert.read_bytes())
    # One connection each (no shared subchannel), as from several clients.
    channels = [
        grpc.aio.secure_channel(
            f"127.0.0.1:{port}", credentials, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        for _ in range(CONNECTIONS)
    ]
    never = asyncio.Event()
    try:
        calls = [
            channel.stream_unary(METHOD)(_never(never))
            for channel in channels
            for _ in range(LIMITS.max_concurrent_streams)
        ]
        started = asyncio.get_running_loop().time()
        codes = await asyncio.wait_for(asyncio.gather(*(_code(call) for call in calls)), timeout=30)
        took = asyncio.get_running_loop().time() - started
        # A fresh call is served again once the held ones are gone.
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as fresh:
            assert await fresh.unary_unary(METHOD)(b"ping", timeout=10) == b"ping"
    finally:
        never.set()
        for channel in channels:
            await channel.close()
        await server.stop(None)
    refused = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    print(
        f"{len(calls)} calls that never sent their message: {refused} refused at once, "
        f"{len(calls) - refused} held until their connection ended, all ended in {took:.1f} s"
    )
    assert refused >= len(calls) - LIMITS.max_concurrent_rpcs
    assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}


async def _code(call: grpc.aio.StreamUnaryCall[bytes, bytes]) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_the_anonymous_listener_holds_less_than_the_mutual_tls_one() -> None:
    assert ENROLLMENT_LIMITS.max_concurrent_rpcs < PUBLIC_LIMITS.max_concurrent_rpcs
    assert ENROLLMENT_LIMITS.max_connection_age_ms < PUBLIC_LIMITS.max_connection_age_ms
    for limits in (ENROLLMENT_LIMITS, PUBLIC_LIMITS):
        assert limits.max_concurrent_streams * 2 <= limits.max_concurrent_rpcs
        names = {name for name, _ in limits.server_options()}
        assert names == {
            "grpc.max_concurrent_streams",
            "grpc.max_connection_age_ms",
            "grpc.max_connection_age_grace_ms",
            "grpc.max_connection_idle_ms",
        }
