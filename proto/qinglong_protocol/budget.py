"""A time budget that holds however the database behaves (SPEC R-ERR-2).

Ingress bounds a call's admission with it, control each command.

`asyncio.timeout` cancels the work and then waits for it to unwind. Work inside a psycopg
statement answers a cancellation by asking the server to cancel the statement and
waiting for that (up to about 10 s more), and a pooled connection returned broken makes
its holder wait for a check of the idle ones: against a hung server, the caller would
answer long after its budget. Here the caller answers when the budget is spent, and the
work unwinds on its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def settle_within(seconds: float, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result if it ends within ``seconds``; else ``TimeoutError`` at once, the
    work cancelled and left to finish in the background."""
    task = asyncio.get_running_loop().create_task(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:  # the caller itself gave up
        _abandon(task)
        raise
    if not done:
        _abandon(task)
        raise TimeoutError
    return task.result()


def _abandon(task: asyncio.Task[Any]) -> None:
    task.cancel()
    # Its outcome is nobody's any more; retrieving it keeps asyncio from logging it.
    task.add_done_callback(lambda ended: ended.cancelled() or ended.exception())
