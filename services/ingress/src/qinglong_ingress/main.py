"""`qinglong-ingress`: run the public ingress service until SIGTERM or SIGINT.

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

from qinglong_protocol.probe import run_probe

from qinglong_ingress.server import create_server, open_control_channel
from qinglong_ingress.settings import (
    DEFAULT_LISTEN_ADDRESS,
    IngressSettings,
    parse_ingress_settings,
)

SERVICE = "ingress"

_log = logging.getLogger(__name__)


async def serve(settings: IngressSettings) -> None:
    # HOOK(worker-ingress pool): open the worker-ingress role's AsyncConnectionPool from
    # settings.database_url here (audit rows, credential lookups) and close it after
    # `server.stop()`. HOOK(forwarding): the servicers get this channel as their only
    # port to the runtime (`as control_channel`, then PublicServicers for create_server).
    async with open_control_channel(settings.control):
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
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["probe"]:
        sys.exit(
            run_probe(
                arguments[1:],
                program="qinglong-ingress",
                env_prefix="QINGLONG_INGRESS_",
                default_listen_address=DEFAULT_LISTEN_ADDRESS,
            )
        )
    settings = parse_ingress_settings(arguments)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
