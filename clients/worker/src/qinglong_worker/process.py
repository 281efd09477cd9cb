"""The local process controller (SPEC R-W-3, R-TO-2).

A process is known by its *identity*: PID plus the process start time in clock ticks
since boot (field 22 of ``/proc/<pid>/stat``). A PID alone could name another process
after reuse; a PID whose start time differs is not ours and is never signalled.

* :meth:`ProcessController.spawn` runs an argv (never a shell) in a session of its
  own, hands it ``timeout_ms`` and the durable deadline as environment variables, and
  returns its identity. The timing variables fail closed: one-sided, negative,
  out-of-range or non-integer values refuse the start.
* :meth:`ProcessController.stop` signals only a verified identity: SIGTERM, a grace
  period, then SIGKILL, through a pidfd so that the verified process is the one that
  receives the signal. It reports ``stopped``, ``already_exited`` or ``unverified``.
* :meth:`ProcessController.poll` reaps a child's exit status without blocking.

Nothing here keeps a timer: a process is stopped on timeout only when lease control
answers ``stop_requested(timeout)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO, Final

from qinglong_protocol import bounds

TIMEOUT_ENV: Final = "QINGLONG_TIMEOUT_MS"
DEADLINE_ENV: Final = "QINGLONG_DEADLINE_UNIX_MS"
#: Variables of the Worker itself are not handed to the executor.
_PRIVATE_ENV_PREFIX: Final = "QINGLONG_"
_HANDLE_PATTERN: Final = re.compile(r"\Apid:([1-9][0-9]{0,9});start:([0-9]{1,20})\Z")
_DECIMAL: Final = re.compile(r"\A[0-9]{1,16}\Z")
_POLL_SECONDS: Final = 0.02


class ExecutorRefused(ValueError):
    """The executor refuses to start (bad timing values or an invalid argv)."""


class StopResult(StrEnum):
    STOPPED = "stopped"
    ALREADY_EXITED = "already_exited"
    UNVERIFIED = "unverified"


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_ticks: int

    @property
    def handle(self) -> str:
        """The executor handle sent with `running` (≤ 512 bytes, no secrets)."""
        return f"pid:{self.pid};start:{self.start_ticks}"

    @classmethod
    def from_handle(cls, handle: str) -> ProcessIdentity:
        match = _HANDLE_PATTERN.match(handle)
        if match is None:
            raise ValueError("not an executor handle")
        return cls(int(match[1]), int(match[2]))


@dataclass(frozen=True)
class ExitStatus:
    """How a process ended. Both fields are None when the status could not be observed
    (the process was not our child, e.g. after a Worker restart)."""

    exit_code: int | None
    signal: int | None

    @property
    def observed(self) -> bool:
        return self.exit_code is not None or self.signal is not None


UNOBSERVED_EXIT: Final = ExitStatus(None, None)


class _Probe(StrEnum):
    RUNNING = "running"
    EXITED = "exited"
    """Gone, or a zombie with our start time."""
    MISMATCH = "mismatch"
    """The PID names a process with another start time."""
    UNKNOWN = "unknown"
    """/proc could not be read."""


# --- /proc ------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str]:
    """Fields 3.. of /proc/<pid>/stat (after the parenthesised command name)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def read_start_ticks(pid: int) -> int:
    """Process start time since boot in clock ticks (field 22 of /proc/<pid>/stat)."""
    return int(_stat_fields(pid)[22 - 3])


def _probe(identity: ProcessIdentity) -> _Probe:
    try:
        fields = _stat_fields(identity.pid)
    except FileNotFoundError:
        return _Probe.EXITED
    except (OSError, ValueError):
        return _Probe.UNKNOWN
    try:
        state, start = fields[0], int(fields[22 - 3])
    except (IndexError, ValueError):
        return _Probe.UNKNOWN
    if start != identity.start_ticks:
        return _Probe.MISMATCH
    return _Probe.EXITED if state in ("Z", "X") else _Probe.RUNNING


# --- timing environment (R-TO-2) -----------------------------------------------------------


def timing_environment(timeout_ms: int | None, deadline_unix_ms: int | None) -> dict[str, str]:
    """The variables that hand ``timeoutMs + deadline`` to the executor."""
    if (timeout_ms is None) != (deadline_unix_ms is None):
        raise ExecutorRefused("timeout and deadline must be both present or both absent")
    if timeout_ms is None or deadline_unix_ms is None:
        return {}
    environment = {TIMEOUT_ENV: str(timeout_ms), DEADLINE_ENV: str(deadline_unix_ms)}
    check_timing_environment(environment)
    return environment


def check_timing_environment(environment: Mapping[str, str]) -> tuple[int | None, int | None]:
    """Parse the executor's timing variables, failing closed.

    Returns ``(timeout_ms, deadline_unix_ms)``, both None when neither is set. A
    one-sided pair, a negative, signed, fractional, non-decimal or out-of-range value
    raises :class:`ExecutorRefused`.
    """
    raw_timeout, raw_deadline = environment.get(TIMEOUT_ENV), environment.get(DEADLINE_ENV)
    if raw_timeout is None and raw_deadline is None:
        return None, None
    if raw_timeout is None or raw_deadline is None:
        raise ExecutorRefused("one-sided timing: timeout and deadline come together")
    timeout_ms = _strict_integer(TIMEOUT_ENV, raw_timeout)
    deadline_unix_ms = _strict_integer(DEADLINE_ENV, raw_deadline)
    if not bounds.is_timeout_ms(timeout_ms):
        raise ExecutorRefused(f"{TIMEOUT_ENV} is out of range")
    if not bounds.is_safe_positive(deadline_unix_ms):
        raise ExecutorRefused(f"{DEADLINE_ENV} is out of range")
    return timeout_ms, deadline_unix_ms


def _strict_integer(name: str, raw: str) -> int:
    if _DECIMAL.match(raw) is None:
        raise ExecutorRefused(f"{name} is not a non-negative decimal integer")
    return int(raw)


def executor_environment(
    base: Mapping[str, str], extra: Mapping[str, str], timing: Mapping[str, str]
) -> dict[str, str]:
    """The Worker's environment without its own ``QINGLONG_*`` settings, plus ``extra``
    and the timing variables (which nothing else may set)."""
    environment = {k: v for k, v in base.items() if not k.startswith(_PRIVATE_ENV_PREFIX)}
    environment.update({k: v for k, v in extra.items() if k not in (TIMEOUT_ENV, DEADLINE_ENV)})
    environment.update(timing)
    return environment


# --- the controller ---------------------------------------------------------------------------


class ProcessController:
    """Spawns, observes and stops executor processes by verified identity."""

    def __init__(self, *, base_environment: Mapping[str, str] | None = None) -> None:
        self._base = dict(os.environ if base_environment is None else base_environment)
        # Our own children, so their exit status can be reaped (and nothing else reaps it).
        self._children: dict[ProcessIdentity, subprocess.Popen[bytes]] = {}

    def spawn(
        self,
        argv: Sequence[str],
        *,
        timeout_ms: int | None,
        deadline_unix_ms: int | None,
        extra_environment: Mapping[str, str] | None = None,
        log_path: Path | None = None,
    ) -> ProcessIdentity:
        """Start ``argv`` in a new session; raise ExecutorRefused or OSError if it can't."""
        if not bounds.is_command_argv(argv):
            raise ExecutorRefused("argv is empty or out of bounds")
        environment = executor_environment(
            self._base, extra_environment or {}, timing_environment(timeout_ms, deadline_unix_ms)
        )
        check_timing_environment(environment)
        output: IO[bytes] | int = subprocess.DEVNULL
        if log_path is not None:
            descriptor = os.open(
                log_path,
                os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW,
                0o600,
            )
            output = os.fdopen(descriptor, "ab")
        try:
            child = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=output,
                env=environment,
                start_new_session=True,
                close_fds=True,
            )
        finally:
            if not isinstance(output, int):
                output.close()
        try:
            identity = ProcessIdentity(child.pid, read_start_ticks(child.pid))
        except (OSError, ValueError, IndexError):
            # Unidentifiable (cannot happen for a live child on Linux): do not keep it.
            child.kill()
            child.wait()
            raise
        self._children[identity] = child
        return identity

    def poll(self, identity: ProcessIdentity) -> ExitStatus | None:
        """None while the process runs; its exit status once it ended.

        A child of this controller is reaped (WNOHANG). Any other process — e.g. one
        started before the Worker restarted — is observed through /proc only, so its
        status is unobserved; a PID that now names another process means ours is gone.
        """
        child = self._children.get(identity)
        if child is not None:
            code = child.poll()
            if code is None:
                return None
            return ExitStatus(None, -code) if code < 0 else ExitStatus(code, None)
        probe = _probe(identity)
        if probe in (_Probe.RUNNING, _Probe.UNKNOWN):
            return None
        return UNOBSERVED_EXIT

    def release(self, identity: ProcessIdentity) -> None:
        """Forget a reaped child once its exit status is persisted."""
        child = self._children.get(identity)
        if child is not None and child.returncode is not None:
            del self._children[identity]

    async def stop(
        self,
        identity: ProcessIdentity,
        *,
        grace_seconds: float = 5.0,
        kill_wait_seconds: float = 5.0,
    ) -> StopResult:
        """SIGTERM the verified identity (and its process group), wait ``grace_seconds``,
        then SIGKILL; never signal a PID whose start time is not ``identity``'s."""
        first = self._observe(identity)
        if first is _Probe.EXITED:
            return StopResult.ALREADY_EXITED
        if first is not _Probe.RUNNING:
            return StopResult.UNVERIFIED
        try:
            pidfd = os.pidfd_open(identity.pid)
        except ProcessLookupError:
            return StopResult.ALREADY_EXITED
        except OSError:
            return StopResult.UNVERIFIED
        try:
            # The pidfd pins one process; re-verify so it is pinned to *ours*.
            pinned = self._observe(identity)
            if pinned is _Probe.EXITED:
                return StopResult.ALREADY_EXITED
            if pinned is not _Probe.RUNNING:
                return StopResult.UNVERIFIED
            for signal_number, wait_seconds in (
                (signal.SIGTERM, grace_seconds),
                (signal.SIGKILL, kill_wait_seconds),
            ):
                delivered = self._signal(pidfd, identity, signal_number)
                if delivered is not None:
                    return delivered
                if await self._wait_exit(identity, wait_seconds):
                    return StopResult.STOPPED
            return StopResult.UNVERIFIED
        finally:
            os.close(pidfd)

    def _signal(
        self, pidfd: int, identity: ProcessIdentity, signal_number: signal.Signals
    ) -> StopResult | None:
        """Signal the pinned process, then its group; a result if that already decides."""
        try:
            signal.pidfd_send_signal(pidfd, signal_number)
        except ProcessLookupError:
            return None  # it ended meanwhile; the wait that follows observes (and reaps) it
        except PermissionError:
            return StopResult.UNVERIFIED
        # The process leads its own session and group (start_new_session), so the group
        # id is its PID; reach what it started too. The leader was alive a moment ago.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(identity.pid, signal_number)
        return None

    async def _wait_exit(self, identity: ProcessIdentity, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while True:
            if self._observe(identity) is not _Probe.RUNNING:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL_SECONDS)

    def _observe(self, identity: ProcessIdentity) -> _Probe:
        """Probe via /proc, reaping our own child first so it does not linger as a zombie."""
        child = self._children.get(identity)
        if child is not None and child.returncode is not None:
            return _Probe.EXITED
        probe = _probe(identity)
        # Poll after the probe: a zombie the probe saw is reaped here, not left behind.
        if child is not None and child.poll() is not None:
            return _Probe.EXITED
        return probe
