"""A Worker that spawns one executor through the Worker's own ProcessController and is
then killed with SIGKILL: the executor's supervisor is nobody's child in the test
process, exactly as after a Worker crash."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from qinglong_worker.process import ProcessIdentity

_STAND_IN = """
import asyncio
import sys
from pathlib import Path
from qinglong_worker.process import ProcessController
controller = ProcessController(status_dir=Path(sys.argv[1]))
identity = asyncio.run(
    controller.spawn_async(
        sys.argv[3:], timeout_ms=None, deadline_unix_ms=None, launch_key=sys.argv[2] or None
    )
)
print(identity.handle, flush=True)
sys.stdin.read()
"""


def spawn_then_lose_the_worker(
    status_dir: Path, argv: list[str], launch_key: str | None = None
) -> ProcessIdentity:
    """Spawn ``argv`` (with a launch claim under ``launch_key``, if given) from another
    process, kill -9 that process, and return the supervisor's identity."""
    with subprocess.Popen(
        [sys.executable, "-c", _STAND_IN, str(status_dir), launch_key or "", *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as worker:
        assert worker.stdout is not None
        handle = worker.stdout.readline().strip()
        worker.kill()
        worker.wait()
    return ProcessIdentity.from_handle(handle)
