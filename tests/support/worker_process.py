"""`qinglong-worker run` as a real subprocess: start it against an address (ingress, or a
lossy proxy in front of it), signal it, kill -9 it, and start it again on the same inbox.

Its log goes to a file next to the inbox (never a pipe that could fill up and block it),
appended to across restarts so one file tells the whole story of a test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from tests.support.devstack_process import DevStack

QINGLONG_WORKER: Final = Path(sys.executable).with_name("qinglong-worker")
STOP_TIMEOUT_SECONDS: Final = 60.0
#: What the daemon logs once its loop handles SIGTERM/SIGINT (qinglong_worker.daemon).
_READY_LINE: Final = ": running (inbox "

#: Short cadences so that faults are met, and recovered from, within seconds.
FAST_FLAGS: Final = (
    "--tick-seconds",
    "0.2",
    "--lease-control-seconds",
    "0.5",
    "--stop-grace-seconds",
    "2",
)


class WorkerProcess:
    def __init__(
        self,
        stack: DevStack,
        inbox: Path,
        *,
        address: str,
        max_concurrency: int = 2,
        extra_flags: Sequence[str] = (),
    ) -> None:
        self.inbox = inbox
        self.log = inbox.with_name("worker.log")
        self.argv = [
            str(QINGLONG_WORKER),
            "run",
            "--stack",
            str(stack.stack_path),
            "--ingress-address",
            address,
            "--inbox",
            str(inbox),
            "--max-concurrency",
            str(max_concurrency),
            *FAST_FLAGS,
            *extra_flags,
        ]
        inbox.parent.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen[bytes] | None = None
        self.incarnations = 0

    def start(self) -> WorkerProcess:
        """Start (or start again, on the same inbox)."""
        assert self.process is None or self.process.poll() is not None, "already running"
        with self.log.open("ab") as log:
            log.write(f"--- test: start #{self.incarnations + 1}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        self.incarnations += 1
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill9(self) -> None:
        """SIGKILL, from any thread (the proxy calls it at a fault point). Not reaped here:
        the test's thread does that with :meth:`wait`."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)

    def ready(self, timeout: float = 15.0) -> bool:
        """Wait until this incarnation logged that it runs (its signal handlers are in
        place) or exited. The first milliseconds of an interpreter cannot catch a signal,
        so a test that signals at once would test Python's start-up, not the Worker."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.log_text().count(_READY_LINE) >= self.incarnations or not self.alive():
                return True
            time.sleep(0.02)
        return False

    def signal(self, number: int) -> None:
        self.ready()
        if self.alive():
            assert self.process is not None
            self.process.send_signal(number)

    def wait(self, timeout: float = STOP_TIMEOUT_SECONDS) -> int | None:
        """The exit status, or None if it is still running after `timeout` seconds."""
        assert self.process is not None
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> int:
        """SIGINT and wait; SIGKILL if that does not end it. The exit status."""
        if self.process is None:
            return 0
        self.signal(signal.SIGINT)
        status = self.wait()
        if status is None:
            self.kill9()
            return self.process.wait()
        return status

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else "(no log)"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])
