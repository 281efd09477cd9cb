"""The real `qinglong` executable, run the way a user runs it, for CLI tests."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tests.support.devstack_process import QINGLONG


@dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str


async def qinglong(*args: str) -> Outcome:
    # A subprocess driven by asyncio: the stack's servers run on this test's event loop.
    process = await asyncio.create_subprocess_exec(
        str(QINGLONG),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return Outcome(process.returncode, out.decode(), err.decode())
