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
from typing import TextIO

from opentelemetry import trace

#: A line written inside a recorded span names its trace, so a log line found on one pod
#: leads to the call's whole trace (Worker, ingress, control, database) and back.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s:%(trace)s %(message)s"


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, handlers=[log_handler(sys.stderr)])


def log_handler(stream: TextIO) -> logging.Handler:
    """Lines in :data:`LOG_FORMAT` on ``stream``."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(_with_trace)
    return handler


def _with_trace(record: logging.LogRecord) -> bool:
    """Sets ``record.trace``: `` trace=<id> span=<id>`` inside a recorded span, else empty."""
    context = trace.get_current_span().get_span_context()
    record.trace = (
        f" trace={context.trace_id:032x} span={context.span_id:016x}"
        if context.is_valid and context.trace_flags.sampled
        else ""
    )
    return True


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
