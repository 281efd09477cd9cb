"""A TCP relay on loopback that can cut every connection through it at once — what a
client sees when the pod behind a Service restarts: its connections end, and new ones
reach a server again — or silence them: they stay open and pass nothing either way, as
when the peer's node lost power (nothing is closed, nothing answers), while new
connections pass as before. Bytes pass through untouched (TLS included), on the test's
event loop."""

from __future__ import annotations

import asyncio
import contextlib


class TcpRelay:
    def __init__(self, upstream: str = "") -> None:
        self._upstream = _host_and_port(upstream) if upstream else ("", 0)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._silenced: set[asyncio.StreamWriter] = set()
        self.connections = 0

    def towards(self, upstream: str) -> str:
        """Relays new connections to ``upstream`` (``host:port``); returns this relay's
        own address (it must be listening), for a client to dial instead."""
        self._upstream = _host_and_port(upstream)
        return self.address

    @property
    def address(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def __aenter__(self) -> TcpRelay:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()
        await self._server.wait_closed()

    def cut(self) -> int:
        """Ends every connection through the relay now; new ones are accepted as before.
        Returns how many were cut."""
        cut = len(self._writers)
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        return cut

    def silence(self) -> int:
        """From now on the connections open through the relay pass no byte either way,
        and stay open; new ones pass as before. Returns how many were silenced."""
        self._silenced |= self._writers
        return len(self._writers) // 2

    async def _relay(
        self, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter
    ) -> None:
        self.connections += 1
        try:
            server_reader, server = await asyncio.open_connection(*self._upstream)
        except OSError:
            client.transport.abort()
            return
        self._writers.update((client, server))
        await asyncio.gather(
            self._pipe(client_reader, server),
            self._pipe(server_reader, client),
            return_exceptions=True,
        )
        for writer in (client, server):
            self._writers.discard(writer)
            self._silenced.discard(writer)
            writer.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(1 << 16):
                if writer in self._silenced:
                    continue  # read (so the sender's kernel sees it arrive), never passed
                writer.write(data)
                await writer.drain()
        writer.transport.abort()  # one side ended: so does the other


def _host_and_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)
