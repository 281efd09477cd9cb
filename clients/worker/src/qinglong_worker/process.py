"""The local process controller (SPEC R-W-3, R-TO-2).

A process is known by its *identity*: PID plus the process start time in clock ticks
since boot (field 22 of ``/proc/<pid>/stat``), plus the boot's id. A PID alone could name
another process after reuse; a PID whose start time differs is not ours and is never
signalled, and neither is anything under an identity of an earlier boot.

* :meth:`ProcessController.spawn_async` runs an argv (never a shell) under a small
  supervisor (:mod:`qinglong_worker.supervisor`) in a session of its own, hands it
  ``timeout_ms`` and the durable deadline as environment variables, and returns the
  supervisor's identity — the identity the inbox records and every stop targets. The
  timing variables fail closed: one-sided, negative, out-of-range or non-integer values
  refuse the start. It waits for the supervisor's answer (its interpreter's start and
  the launch claim's fsyncs: tens of milliseconds, up to :data:`_READY_TIMEOUT_SECONDS`
  on a slow disk) on the event loop, so lease control and the session's renewal go on
  for every other Run meanwhile.
* A spawn with a launch key is claimed durably by its supervisor before the executor
  starts (:mod:`qinglong_worker.launch` settles it after a Worker crash).
* The supervisor writes the executor's exit status durably into the status directory
  (one file per identity) before it ends its group (itself included, by SIGKILL), so
  the status survives a Worker crash:
  :meth:`ProcessController.poll` reads it whether or not the supervisor is this
  Worker's child.
* :meth:`ProcessController.stop` signals only a verified identity: SIGTERM, a grace
  period, then SIGKILL, through a pidfd so that the verified process is the one that
  receives the signal. SIGTERM goes to the supervisor, which forwards it once to the
  executor's group; SIGKILL goes to the whole group (supervisor, executor and what it
  started). It reports ``stopped``, ``already_exited`` or ``unverified``.
* The controller remembers, in memory, every identity it spawned or saw running, so
  :meth:`ProcessController.stop_all` can stop them even when the inbox cannot be read.

Nothing here keeps a timer: a process is stopped on timeout only when lease control
answers ``stop_requested(timeout)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO, Any, Final

from qinglong_protocol import bounds

from qinglong_worker import supervisor
from qinglong_worker.clock import this_boot as _this_boot

log = logging.getLogger(__name__)

TIMEOUT_ENV: Final = "QINGLONG_TIMEOUT_MS"
DEADLINE_ENV: Final = "QINGLONG_DEADLINE_UNIX_MS"
#: Variables of the Worker itself are not handed to the executor.
_PRIVATE_ENV_PREFIX: Final = "QINGLONG_"
_DECIMAL: Final = re.compile(r"\A[0-9]{1,16}\Z")
_POLL_SECONDS: Final = 0.02
#: The supervisor runs as a script of this interpreter, isolated (-I: no PYTHON*
#: variables, no user site, no script directory on the path); it needs only the stdlib.
SUPERVISOR_SCRIPT: Final = Path(supervisor.__file__)
#: How long a spawn waits for the supervisor to say whether the executor started.
_READY_TIMEOUT_SECONDS: Final = 10.0
#: How long a supervisor that did not start its executor is waited for after its group's
#: SIGKILL (a process in uninterruptible sleep, e.g. on a hung disk, dies only when that
#: ends); one not reaped by then is reaped later (see ``_reap_strays``).
_REAP_SECONDS: Final = 5.0
_STATUS_DIRECTORY_MODE: Final = 0o700


class ExecutorRefused(ValueError):
    """The executor refuses to start (bad timing values or an invalid argv)."""


class LaunchUnanswered(Exception):
    """The supervisor of a claimed launch did not answer in time (it may live on, or have
    ended with its executor meanwhile): whether its executor started is for the launch
    claim to say (:mod:`qinglong_worker.launch`), not for a kill that could end an
    executor already running, nor for a start failure reported of one that ran."""

    def __init__(self, identity: ProcessIdentity) -> None:
        super().__init__("the executor supervisor has not reported its start yet")
        self.identity = identity


class StopResult(StrEnum):
    STOPPED = "stopped"
    ALREADY_EXITED = "already_exited"
    UNVERIFIED = "unverified"


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as this Worker names it: PID, start time and the boot they belong to
    (None for an identity recorded before Workers recorded it)."""

    pid: int
    start_ticks: int
    boot_id: str | None = None

    @property
    def handle(self) -> str:
        """The executor handle sent with `running` (≤ 512 bytes, no secrets)."""
        return supervisor.handle_of(self.pid, self.start_ticks, self.boot_id)

    def named_by(self, document: Mapping[str, Any]) -> bool:
        """Whether a supervisor's status or launch document names this process: its
        ``supervisor`` field (``pid:…;start:…``, as every version writes it) and, when
        both say, the same ``boot``."""
        if document.get("supervisor") != supervisor.handle_of(self.pid, self.start_ticks, None):
            return False
        boot = document.get("boot")
        return boot is None or self.boot_id is None or boot == self.boot_id

    @classmethod
    def from_handle(cls, handle: str) -> ProcessIdentity:
        match = supervisor.HANDLE_PATTERN.match(handle)
        if match is None:
            raise ValueError("not an executor handle")
        return cls(int(match[1]), int(match[2]), match[3])

    @property
    def from_an_earlier_boot(self) -> bool:
        current = _this_boot()
        return self.boot_id is not None and current is not None and self.boot_id != current


@dataclass(frozen=True)
class ExitStatus:
    """How a process ended. Both fields are None when the status could not be observed
    (the process was not our child, e.g. after a Worker restart)."""

    exit_code: int | None
    signal: int | None
    lease_ran_out: bool = False
    """The supervisor stopped the executor itself: the lease the Worker last wrote for it
    had run out (see :mod:`qinglong_worker.supervisor`, the lease watch)."""
    lost_with_supervisor: bool = False
    """The supervisor ended without a status and not by this Worker's hand: killed from
    outside (a container restart, a reboot, by hand), taking the executor with it, so
    the executor did not end on its own (or a supervisor that could not write its
    status, which a restarted Worker cannot tell apart)."""

    @property
    def observed(self) -> bool:
        return self.exit_code is not None or self.signal is not None


#: How long an executor's status may stay unreadable before its ending is taken as not
#: observable: a passing fault (EMFILE while the daemon is short of descriptors, an EIO)
#: is waited out — its lease is renewed meanwhile — one that stays is not waited on for
#: ever. A time, not a number of polls: a poll comes every tick, so ten of them were gone
#: in about a second, less than such a fault lasts.
UNREADABLE_STATUS_SECONDS: Final = 60.0

UNOBSERVED_EXIT: Final = ExitStatus(None, None)
"""The executor ended by itself, how is unknown (its status cannot be read)."""
LOST_WITH_SUPERVISOR: Final = ExitStatus(None, None, lost_with_supervisor=True)


class _Probe(StrEnum):
    RUNNING = "running"
    EXITED = "exited"
    """Gone, or a zombie with our start time."""
    MISMATCH = "mismatch"
    """The PID names a process with another start time."""
    UNKNOWN = "unknown"
    """/proc could not be read."""


#: The process an identity names has ended: its PID is free, or names a process started at
#: another time (a PID and its start time name one process within a boot), which is never
#: signalled.
_GONE: Final = frozenset({_Probe.EXITED, _Probe.MISMATCH})


# --- /proc ------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str]:
    """Fields 3.. of /proc/<pid>/stat (after the parenthesised command name)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def read_start_ticks(pid: int) -> int:
    """Process start time since boot in clock ticks (field 22 of /proc/<pid>/stat)."""
    return int(_stat_fields(pid)[22 - 3])


def _probe(identity: ProcessIdentity) -> _Probe:
    if identity.from_an_earlier_boot:
        return _Probe.EXITED  # it ended with that boot; whatever has its PID now is another
    try:
        fields = _stat_fields(identity.pid)
    except FileNotFoundError:
        return _Probe.EXITED
    except (OSError, ValueError):
        return _Probe.UNKNOWN
    try:
        state, threads, start = fields[0], int(fields[20 - 3]), int(fields[22 - 3])
    except (IndexError, ValueError):
        return _Probe.UNKNOWN
    if start != identity.start_ticks:
        return _Probe.MISMATCH
    if state == "Z" and threads > 1:
        # Its main thread ended, another (a supervisor's output relay) has not yet: it
        # may still write, so it has not ended.
        return _Probe.RUNNING
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

    def __init__(
        self,
        *,
        base_environment: Mapping[str, str] | None = None,
        status_dir: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        output_limit_bytes: int | None = bounds.OUTPUT_BYTES_PER_ATTEMPT_DEFAULT,
    ) -> None:
        """``status_dir``: where supervisors leave exit statuses (the daemon uses a
        directory beside its inbox). Without it nothing can be spawned and the status of
        a process that is not our child is unobserved. ``clock``: seconds, for how long a
        status has been unreadable. ``output_limit_bytes``: how large an executor's log
        file may grow (the supervisor's "output limit"); None: without bound."""
        self._base = dict(os.environ if base_environment is None else base_environment)
        self._output_limit = output_limit_bytes
        self._clock = clock
        self._status_dir = status_dir
        # Our own children (supervisors), so their exit is reaped (and nothing else reaps it).
        self._children: dict[ProcessIdentity, subprocess.Popen[bytes]] = {}
        # Every identity spawned or seen running: what stop_all() stops when the inbox,
        # which holds the durable identities, can no longer be read.
        self._known: set[ProcessIdentity] = set()
        # Identities whose group got SIGKILL from us: the executor died with them.
        self._killed: set[ProcessIdentity] = set()
        # Since when (``clock``) each executor's status could not be read.
        self._unreadable: dict[ProcessIdentity, float] = {}
        # Identities this controller sent any stop signal (TERM or KILL).
        self._signalled: set[ProcessIdentity] = set()
        # Supervisors killed after a failed start that did not end within the bound.
        self._strays: list[subprocess.Popen[bytes]] = []
        # Supervisors that did not answer within the bound, by launch key: alive, they
        # may still claim their launch (LaunchUnanswered).
        self._unanswered: dict[str, ProcessIdentity] = {}

    @property
    def status_dir(self) -> Path | None:
        return self._status_dir

    async def spawn_async(
        self,
        argv: Sequence[str],
        *,
        timeout_ms: int | None,
        deadline_unix_ms: int | None,
        extra_environment: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        launch_key: str | None = None,
    ) -> ProcessIdentity:
        """Start ``argv`` under a supervisor in a new session; return the supervisor's
        identity. Raise ExecutorRefused, or an OSError (FileNotFoundError, …) when the
        executable could not be started, or ETIMEDOUT when the supervisor did not say
        within :data:`_READY_TIMEOUT_SECONDS` — :class:`LaunchUnanswered` instead when the
        launch has a ``launch_key`` (its supervisor is kept, living or not).

        ``launch_key``: the supervisor claims this launch durably before it starts the
        executor, so that a Worker restarted before it persisted the identity returned
        here can still learn it (:mod:`qinglong_worker.launch`).

        The fork is synchronous (it returns once the supervisor's interpreter is exec'd);
        the wait for the supervisor's answer is on the loop, and so is the reaping of a
        supervisor that failed (bounded). Cancelled while it waits, the supervisor's
        group is killed like after a failed start: nothing this call started is left
        running, whatever the caller knows. (The Reconciler never cancels it: its spawn
        and the persisting of the identity are one step, see ``Reconciler._start``.)"""
        self._reap_strays()
        child, ready_read = self._fork(
            argv,
            timeout_ms=timeout_ms,
            deadline_unix_ms=deadline_unix_ms,
            extra_environment=extra_environment,
            log_path=log_path,
            launch_key=launch_key,
        )
        try:
            # Read while the child is unreaped: even if it already ended, /proc keeps it.
            identity = ProcessIdentity(child.pid, read_start_ticks(child.pid), _this_boot())
            answer = await _await_ready(ready_read, _READY_TIMEOUT_SECONDS)
        except OSError as error:
            if error.errno == errno.ETIMEDOUT and launch_key is not None:
                # Slow, not failed (its claim's fsyncs on a slow disk): it may already
                # run the executor — or have run it to its end and exited meanwhile (a
                # short one, while this loop was held up). Killed now, or reported as a
                # start failure, that execution would be a start that never happened; its
                # launch claim settles it instead (an ended executor is adopted and its
                # status read, one that never started is reported as such).
                self._spawned(identity, child)
                self._unanswered[launch_key] = identity
                raise LaunchUnanswered(identity) from None
            await self._end_group(child)
            raise
        except BaseException:
            await self._end_group(child)
            raise
        finally:
            os.close(ready_read)
        if answer.startswith("ok "):
            return self._spawned(identity, child)
        await self._end_group(child)
        raise start_error(answer)

    def _fork(
        self,
        argv: Sequence[str],
        *,
        timeout_ms: int | None,
        deadline_unix_ms: int | None,
        extra_environment: Mapping[str, str] | None,
        log_path: Path | None,
        launch_key: str | None,
    ) -> tuple[subprocess.Popen[bytes], int]:
        """Check the start, fork the supervisor; the child and the read end of its ready
        pipe (the caller closes it)."""
        if not bounds.is_command_argv(argv):
            raise ExecutorRefused("argv is empty or out of bounds")
        environment = executor_environment(
            self._base, extra_environment or {}, timing_environment(timeout_ms, deadline_unix_ms)
        )
        check_timing_environment(environment)
        status_dir = self.ensure_status_dir()
        output: IO[bytes] | int = subprocess.DEVNULL
        limit: tuple[str, ...] = ()
        if log_path is not None:
            if self._output_limit is not None:
                limit = ("--output-limit", str(self._output_limit))
            descriptor = os.open(
                log_path,
                os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW,
                0o600,
            )
            output = os.fdopen(descriptor, "ab")
        ready_read, ready_write = os.pipe()
        try:
            child = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    str(SUPERVISOR_SCRIPT),
                    "--status-dir",
                    str(status_dir),
                    "--ready-fd",
                    str(ready_write),
                    *(() if launch_key is None else ("--launch", launch_key)),
                    *limit,
                    "--",
                    *argv,
                ],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=output,
                # The executor's environment: the supervisor's isolated interpreter
                # ignores it, and the executor inherits it unchanged.
                env=environment,
                start_new_session=True,
                close_fds=True,
                pass_fds=(ready_write,),
            )
        except BaseException:
            os.close(ready_read)
            raise
        finally:
            os.close(ready_write)
            if not isinstance(output, int):
                output.close()
        return child, ready_read

    def _spawned(
        self, identity: ProcessIdentity, child: subprocess.Popen[bytes]
    ) -> ProcessIdentity:
        self._children[identity] = child
        self._known.add(identity)
        return identity

    async def _end_group(self, child: subprocess.Popen[bytes]) -> None:
        """End a supervisor that did not start its executor (and anything in its group),
        and reap it within :data:`_REAP_SECONDS`, polling between pauses on the loop."""
        _kill_group(child)
        deadline = time.monotonic() + _REAP_SECONDS
        while child.poll() is None:
            if time.monotonic() >= deadline:
                self._stray(child)
                return
            await asyncio.sleep(_POLL_SECONDS)

    def _stray(self, child: subprocess.Popen[bytes]) -> None:
        """A killed supervisor that has not ended yet: reaped by a later spawn."""
        log.warning("executor supervisor %d not yet ended after SIGKILL", child.pid)
        self._strays.append(child)

    def _reap_strays(self) -> None:
        self._strays = [child for child in self._strays if child.poll() is None]

    def poll(self, identity: ProcessIdentity) -> ExitStatus | None:
        """None while the process runs; the executor's exit status once it ended.

        A child of this controller is reaped (WNOHANG). Any identity — a child or one
        started before the Worker restarted — that has ended is looked up in the status
        directory, where its supervisor recorded the executor's status. Without a record
        the status is unobserved, unless this controller killed the group (SIGKILL):
        a supervisor killed by anyone else took its executor with it, which says nothing
        of how the executor would have ended.
        """
        child = self._children.get(identity)
        if child is not None:
            code = child.poll()
            if code is None:
                return None
            return self._ended(identity, code)
        probe = _probe(identity)
        if probe is _Probe.RUNNING:
            self._known.add(identity)
            return None
        if probe is _Probe.UNKNOWN:
            return None
        return self._ended(identity, None)

    def release(self, identity: ProcessIdentity) -> None:
        """Forget an ended process once its exit status is persisted, and remove the
        supervisor's status file (the inbox holds the status now)."""
        child = self._children.get(identity)
        if child is not None and child.returncode is None:
            return
        self._children.pop(identity, None)
        self._known.discard(identity)
        self._killed.discard(identity)
        self._signalled.discard(identity)
        self._unreadable.pop(identity, None)
        for key in [k for k, slow in self._unanswered.items() if slow == identity]:
            del self._unanswered[key]
        path = self._status_path(identity)
        try:
            own = path is not None and self._read_status(identity) is not None
        except OSError:
            own = False  # not read, so not known to be its own: left
        if own and path is not None:
            # Only its own: after a reboot, another boot's supervisor may have the same
            # PID and start time, and so the same file name.
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def known(self) -> frozenset[ProcessIdentity]:
        """Identities spawned or seen running and not yet released."""
        return frozenset(self._known)

    async def stop_all(self, *, grace_seconds: float = 5.0) -> dict[ProcessIdentity, StopResult]:
        """Stop every remembered identity that still runs (verified, TERM then KILL)."""
        running = [identity for identity in self._known if self.poll(identity) is None]
        results = await asyncio.gather(
            *(self.stop(identity, grace_seconds=grace_seconds) for identity in running)
        )
        return dict(zip(running, results, strict=True))

    async def stop(
        self,
        identity: ProcessIdentity,
        *,
        grace_seconds: float = 5.0,
        kill_wait_seconds: float = 5.0,
    ) -> StopResult:
        """SIGTERM the verified identity, wait ``grace_seconds``, then SIGKILL it and its
        process group; never signal a PID whose start time is not ``identity``'s."""
        first = self._observe(identity)
        if first in _GONE:
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
            if pinned in _GONE:
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
        """Signal the pinned process; a result if that already decides.

        SIGTERM goes to the supervisor alone: it forwards it once to its group (the
        executor and what that started). SIGKILL cannot be forwarded, so it goes to the
        whole group first — while the leader is verified alive, the group id (its PID,
        as it leads its own session) is ours — and then to the pinned process.
        """
        self._signalled.add(identity)
        if signal_number == signal.SIGKILL:
            self._killed.add(identity)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if (
                    self._observe(identity) is _Probe.RUNNING
                    and os.getpgid(identity.pid) == identity.pid
                ):
                    os.killpg(identity.pid, signal_number)
        try:
            signal.pidfd_send_signal(pidfd, signal_number)
        except ProcessLookupError:
            return None  # it ended meanwhile; the wait that follows observes (and reaps) it
        except PermissionError:
            return StopResult.UNVERIFIED
        return None

    def unanswered_supervisor(self, launch_key: str) -> ProcessIdentity | None:
        """The live supervisor this controller spawned for ``launch_key`` that has not
        answered yet (:class:`LaunchUnanswered`); None once it has ended (it is reaped)."""
        identity = self._unanswered.get(launch_key)
        if identity is not None and self.poll(identity) is not None:
            del self._unanswered[launch_key]
            return None
        return identity

    def signalled(self, identity: ProcessIdentity) -> bool:
        """Whether this controller ever sent ``identity`` a stop signal (in this process:
        a Worker restarted since cannot tell)."""
        return identity in self._signalled

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
        if child is not None and probe is _Probe.EXITED:
            # A zombie leader that cannot be reaped yet: its other threads (a supervisor's
            # output relay) are still ending. Until it can be reaped it has not ended --
            # and reported ended now, it would be forgotten unreaped.
            return _Probe.RUNNING
        return probe

    # --- exit statuses -------------------------------------------------------------------------

    def _ended(self, identity: ProcessIdentity, supervisor_code: int | None) -> ExitStatus | None:
        """How the executor of an ended supervisor ended; None while that is undecided (a
        status there that could not be read just now: the next poll reads it again)."""
        if supervisor_code == supervisor.EXIT_STATUS_UNWRITTEN:
            # Our child said it could not write one: there is none to wait for, and
            # whatever is at its path (a directory, a half file) is not it.
            return UNOBSERVED_EXIT
        try:
            recorded = self._read_status(identity)
        except OSError as error:
            since = self._unreadable.setdefault(identity, self._clock())
            waited = self._clock() - since
            log.warning(
                "exit status of %s unreadable for %.1f s: %s",
                identity.handle,
                waited,
                error.strerror,
            )
            if waited < UNREADABLE_STATUS_SECONDS:
                return None  # EMFILE, EIO...: its ending is not decided on a passing fault
            return UNOBSERVED_EXIT
        self._unreadable.pop(identity, None)
        if recorded is not None:
            return recorded
        path = self._status_path(identity)
        if path is not None and path.exists():
            # The supervisor wrote a status (and then, as it does, SIGKILLed its group,
            # itself included) that cannot be read: how the executor ended is unknown.
            return UNOBSERVED_EXIT
        if identity in self._killed:
            return ExitStatus(None, signal.SIGKILL)  # the group was killed, by us
        if supervisor_code is not None and supervisor_code >= 0:
            # Our child exited with a code (4: the status could not be written): the
            # executor ended by itself, how is unknown.
            return UNOBSERVED_EXIT
        # Killed by someone else (the executor then got its parent-death SIGKILL), or gone
        # before this Worker started: the execution was lost with its supervisor.
        return LOST_WITH_SUPERVISOR

    def _status_path(self, identity: ProcessIdentity) -> Path | None:
        if self._status_dir is None:
            return None
        return self._status_dir / supervisor.status_file_name(identity.pid, identity.start_ticks)

    def _read_status(self, identity: ProcessIdentity) -> ExitStatus | None:
        """The recorded status; None if there is none or it is malformed (for good).
        Raises OSError when it could not be read (EMFILE, EIO, a directory there)."""
        path = self._status_path(identity)
        if path is None:
            return None
        try:
            descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        try:
            raw = os.read(descriptor, 4096)
        finally:
            os.close(descriptor)
        status = parse_status_document(raw, identity)
        if status is None:
            log.warning("exit status of %s is malformed; treated as unobserved", identity.handle)
        return status

    def ensure_status_dir(self) -> Path:
        """The status directory, made if need be (supervisors' statuses, launch claims and
        lease files)."""
        if self._status_dir is None:
            raise RuntimeError("this ProcessController has no status directory to spawn with")
        self._status_dir.mkdir(parents=True, exist_ok=True, mode=_STATUS_DIRECTORY_MODE)
        return self._status_dir


def parse_status_document(raw: bytes, identity: ProcessIdentity) -> ExitStatus | None:
    """The exit status a supervisor recorded for ``identity``; None unless well formed."""
    try:
        document: Any = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    if document.get("version") != supervisor.STATUS_VERSION or not identity.named_by(document):
        return None
    exit_code, signal_number = document.get("exit_code"), document.get("signal")
    lease_ran_out = document.get("lease_ran_out", False)
    if not isinstance(lease_ran_out, bool):
        return None
    if isinstance(exit_code, int) and signal_number is None and 0 <= exit_code <= 255:
        return ExitStatus(exit_code, None, lease_ran_out)
    if exit_code is None and isinstance(signal_number, int) and 1 <= signal_number <= 64:
        return ExitStatus(None, signal_number, lease_ran_out)
    return None


async def _await_ready(descriptor: int, timeout_seconds: float) -> str:
    """The supervisor's one-line answer ('' if it ended without one), read by the event
    loop when the pipe is readable: everything else runs meanwhile."""
    loop = asyncio.get_running_loop()
    os.set_blocking(descriptor, False)
    answered: asyncio.Future[None] = loop.create_future()
    received = bytearray()

    def readable() -> None:
        if answered.done():
            return
        try:
            chunk = os.read(descriptor, 256)
        except BlockingIOError:
            return
        except OSError as error:
            answered.set_exception(error)
            return
        received.extend(chunk)
        if not chunk or b"\n" in received or len(received) >= 256:
            answered.set_result(None)

    loop.add_reader(descriptor, readable)
    try:
        async with asyncio.timeout(timeout_seconds):
            await answered
    except TimeoutError:
        # A loop held up past the bound (a slow fsync, starved of CPU) runs the reader and
        # the timer in the same turn: the timer still cancels the wait, but the answer has
        # come, and it is the answer — an executor that started must never be taken for
        # one that did not.
        if not answered.done() or answered.cancelled():
            message = "the executor supervisor did not report its start"
            raise OSError(errno.ETIMEDOUT, message) from None
        answered.result()  # the read's own error, if that is how it ended
    finally:
        loop.remove_reader(descriptor)
    return bytes(received).decode("ascii", "replace").strip()


def start_error(answer: str) -> OSError:
    """The OSError a failed exec raised in the supervisor (FileNotFoundError, …)."""
    parts = answer.split()
    if len(parts) == 3 and parts[0] == "error" and parts[1].isdigit() and int(parts[1]) > 0:
        number = int(parts[1])
        # OSError(errno, …) is the matching subclass (ENOENT: FileNotFoundError).
        return OSError(number, os.strerror(number))
    return OSError(errno.ECHILD, "the executor supervisor could not start the executable")


def _kill_group(child: subprocess.Popen[bytes]) -> None:
    """SIGKILL a supervisor that did not start its executor, and anything in its group
    (the caller reaps it, within a bound)."""
    if child.returncode is not None:
        return  # reaped already: its PID (and group id) may name another process now
    # Unreaped, even if it ended: its PID, and so its group id, is still its own.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
