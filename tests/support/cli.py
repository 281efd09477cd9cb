"""The real `qinglong` executable, run the way a user runs it, for CLI tests."""

from __future__ import annotations

import asyncio
import resource
from dataclasses import dataclass

from tests.support.devstack_process import QINGLONG


@dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str


async def qinglong(*args: str, file_size_limit: int | None = None) -> Outcome:
    """``file_size_limit``: the process's RLIMIT_FSIZE — a real write failure (EFBIG) for
    any file it writes beyond that many bytes (Python ignores SIGXFSZ)."""

    def limited() -> None:
        assert file_size_limit is not None
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    # A subprocess driven by asyncio: the stack's servers run on this test's event loop.
    process = await asyncio.create_subprocess_exec(
        str(QINGLONG),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
        preexec_fn=None if file_size_limit is None else limited,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return Outcome(process.returncode, out.decode(), err.decode())
