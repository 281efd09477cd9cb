"""Waiting for a condition with a deadline: convergence is awaited, never assumed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], seconds: float, interval: float = 0.1) -> bool:
    """Poll `condition()` until it is true (True) or `seconds` pass (False)."""
    deadline = time.monotonic() + seconds
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


async def settled(condition: Callable[[], bool], seconds: float, interval: float = 0.01) -> bool:
    """`wait_until` for a test on the event loop: other tasks run while it waits."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval)
    return True
