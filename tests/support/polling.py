"""Waiting for a condition with a deadline: convergence is awaited, never assumed."""

from __future__ import annotations

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
