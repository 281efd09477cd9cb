"""What every QingLong server process does around its gRPC server's lifetime.

Stdout carries exactly one JSON line once the port is bound, for supervisors
(`qinglong up`, tests) to read; logs go to stderr. SIGTERM and SIGINT start a graceful
stop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys


def configure_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def announce_listening(service: str, port: int, listen_address: str) -> None:
    line = {
        "event": "listening",
        "service": service,
        "port": port,
        "address": listen_address,
        "pid": os.getpid(),
    }
    print(json.dumps(line), flush=True)


async def wait_for_stop_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signal_number, stop.set)
    try:
        await stop.wait()
    finally:
        for signal_number in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signal_number)
