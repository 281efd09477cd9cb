"""`qinglong-control`: run the control (runtime) service until SIGTERM or SIGINT.

Stdout carries exactly one JSON line once the port is bound, for supervisors
(`qinglong up`, tests) to read; logs go to stderr.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence

from qinglong_control.server import create_server
from qinglong_control.settings import ControlSettings, parse_control_settings

SERVICE = "control"

_log = logging.getLogger(__name__)


async def serve(settings: ControlSettings) -> None:
    # HOOK(runtime pool): open the runtime role's psycopg AsyncConnectionPool from
    # settings.database_url here (open=False, check=..., then `await pool.open()`),
    # build the real RuntimeService servicer on it and pass it to create_server
    # (runtime_servicer=...); close the pool after `server.stop()` below. Until then
    # the database URL is accepted but not used.
    server, port = await create_server(settings)
    await server.start()
    _announce_listening(port, settings.listen_address)
    await _wait_for_stop_signal()
    _log.info("stopping; in-flight calls get %.1f s", settings.shutdown_grace_seconds)
    await server.stop(settings.shutdown_grace_seconds)


def _announce_listening(port: int, listen_address: str) -> None:
    line = {
        "event": "listening",
        "service": SERVICE,
        "port": port,
        "address": listen_address,
        "pid": os.getpid(),
    }
    print(json.dumps(line), flush=True)


async def _wait_for_stop_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signal_number, stop.set)
    try:
        await stop.wait()
    finally:
        for signal_number in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signal_number)


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_control_settings(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
