"""The executor's supervisor: the one process that sees the executor end, whatever the Worker does.

An executor's exit status can only be reaped by its parent. If the Worker were that
parent, ``kill -9`` of the Worker would make the status unobservable, and a restarted
Worker could only say "exit status not observable" for a Run that in fact succeeded.
So the Worker starts this small program instead (``python -I supervisor.py …``, the
same interpreter, stdlib only — it never imports the Worker's packages), in a session
and process group of its own, and it:

1. installs handlers that forward SIGTERM, SIGINT and SIGHUP to its process group;
2. starts the executor's argv (never a shell) in that same process group, with the
   environment the Worker prepared (timing variables included, unchanged), stdout and
   stderr inherited (the Worker's per-offer log file) or, with ``--output-limit``, one
   pipe the supervisor copies to that file (see "The output limit"), and
   ``PR_SET_PDEATHSIG=SIGKILL`` so that the executor dies with its supervisor — a
   SIGKILL of the supervisor alone never leaves an orphan running without a lease;
3. reports ``ok <pid>`` (or ``error <errno> <kind>`` when the exec failed) on the
   ready descriptor, so that the Worker learns synchronously whether the start worked;
4. waits for the executor and writes its exit status durably as
   ``<status dir>/<own pid>-<own start ticks>.json`` (temp file, fsync, rename, fsync
   of the directory), named by the supervisor's own identity, which is the identity the
   Worker records, supervises and stops (SPEC R-W-3);
5. ends its process group with SIGKILL, itself included: what the executor left running
   in the background (``cmd &``, a daemon it did not wait for) has no lease once the
   Attempt ended, and would otherwise keep running — and writing to the Attempt's log,
   which the Worker ships before it reports the ending. The status is written first,
   and the Worker reads it before the supervisor's own exit. Only a process that left
   the group (``setsid``) escapes this. (When the status could not be written, the
   supervisor exits 4 instead, leaving the group as it is: a SIGKILL of the supervisor
   would read as the executor's ending.) The exit codes: 3, the executor could not be
   started; 4, the status could not be written.

The supervisor is not tied to the Worker's lifetime: it is not in the Worker's process
group and holds no parent-death signal, so it survives a Worker crash and a restarted
Worker reads the status it left.

The lease watch (with ``--launch KEY``). Outliving the Worker must not mean outliving the
lease: a Worker that never comes back (a crash loop, an inbox moved away, a daemon
disabled) would leave the executor running while the control plane expires the lease and
starts the Run again elsewhere. The Worker writes each lease answer it persists to
``<status dir>/lease-<KEY>.json`` as the boot-clock instant at which its local estimate
runs out (see :mod:`qinglong_worker.local_lease`). While the executor runs, the
supervisor sleeps until that instant — in ``sigtimedwait`` for SIGCHLD, so the
executor's end wakes it at once — at most :data:`LEASE_LOOK_SECONDS` at a time (a sleep
does not count a suspend, and a file may be rewritten), and reads the file again; once
the instant has passed with nothing newer written, it stops the executor itself, as the
Worker would (R-W-2 step 3): SIGTERM to the group, :data:`LEASE_GONE_STOP_GRACE_SECONDS`,
then SIGKILL to the executor, and records ``lease_ran_out`` in the status, so that a
Worker reading it reports a lost lease, never the stop as the executor's own ending. A
file that goes away or cannot be read keeps the last instant read from it; only a file
never seen at all (a Worker of an earlier version) means no watch: the executor is then
waited for as before. The first read comes before the executor starts (the Worker writes
the file before the spawn), so a file the Worker removes at once still counts.

A Worker that can no longer write its inbox cannot keep any lease: it writes
``<status dir>/leases-revoked`` and stops every executor it knows (SIGTERM). A supervisor
that receives the stop while that mark exists records ``lease_ran_out`` too: the stop was
the Worker's fault, not the task's ending, and the restarted Worker reports a lost lease
(the Attempt ends lost and may be retried), never `failed` by SIGTERM. A starting Worker
removes the mark.

The launch claim (``--launch KEY``). The Worker learns the supervisor's identity only
from step 3, so a Worker killed between forking the supervisor and persisting that
identity would come back knowing nothing of an executor that runs. Therefore, before
step 2, the supervisor claims the launch: it creates ``<status dir>/launch-<KEY>.json``
naming itself, exclusively (``link`` of a written, fsynced temp file: the file appears
whole or not at all, and only once). Only a won claim starts the executor; the answer of
step 3 is then recorded in the same file (replaced by ``rename``) before it is reported.
A restarted Worker settles the launch the same way (see :mod:`qinglong_worker.launch`):
it claims the file first with no supervisor in it -- "never started" -- or finds the
supervisor that did, and adopts it. A claim that cannot be made durable starts nothing.
And a Worker that died cannot read the ready descriptor any more: that report is best
effort, never a reason to abandon a started executor.

The output limit (``--output-limit BYTES``). An executor that writes without end would
otherwise fill the Worker's disk, and with it the inbox: one runaway Run would take the
whole Worker down. So the executor writes into a pipe, and a thread of the supervisor
copies the pipe to the log file until the file holds ``BYTES``; it then ends the file
with :data:`OUTPUT_LIMIT_NOTICE` and reads on, discarding, so the executor runs on and
never blocks on a full pipe (as GitLab Runner's ``output_limit`` does: the Run is not
failed for what it printed). The executor's end is waited for as before; the copy then
takes what is left in the pipe (at most :data:`RELAY_DRAIN_SECONDS`: a background process
the executor left may still hold the pipe, and step 5 ends it) before the status is
written, so the file is whole when the Worker reads the status. A file that cannot be
written (a full disk) is written no more, and the pipe is still drained. What a pipe
changes for the executor: writes of several processes sharing it are whole only up to
``PIPE_BUF`` (4 KiB) each, where an ``O_APPEND`` file kept any write whole (parallel
writers such as ``make -j`` may see long lines interleaved); and a SIGKILL of the group
(the Worker's stop after its grace) loses what was still in the pipe, at most its size
(64 KiB by default). The one line the supervisor writes itself when it cannot record a
status goes to the file directly, past the limit if need be.

Stopping (by the Worker, after verifying PID, start time and boot): SIGTERM to the supervisor
alone is forwarded once to every other member of its group (the executor and what it
started); SIGKILL goes to the whole group, so nothing survives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Final

STATUS_VERSION: Final = 1
LAUNCH_VERSION: Final = 1
LEASE_VERSION: Final = 1
#: The longest TERM grace of an executor whose lease is gone, for the supervisor's own
#: stop and the Worker's: a stop without a lease must fit in the control plane's
#: ``--worker-stop-ms`` (20 s by default) before the Run may start elsewhere.
LEASE_GONE_STOP_GRACE_SECONDS: Final = 5.0
#: The longest the lease watch sleeps between two reads of the lease file: a sleep does
#: not count time the machine was suspended (the lease does), so a resumed supervisor is
#: at most this late; and a file written after a look is seen within it.
LEASE_LOOK_SECONDS: Final = 10.0
#: A launch key: hex, as :func:`qinglong_worker.launch.launch_key` makes it (never a path).
LAUNCH_KEY: Final = re.compile(r"\A[0-9a-f]{32}\Z")
#: The answer ``error 17 LaunchFenced`` (EEXIST): a restarted Worker already declared
#: this launch not started, so this supervisor must not start it.
LAUNCH_FENCED: Final = "LaunchFenced"
EXIT_USAGE: Final = 2
EXIT_NOT_STARTED: Final = 3
EXIT_STATUS_UNWRITTEN: Final = 4
FORWARDED_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: Ends a log file at the output limit (``{limit}``: the limit in bytes); the notice is
#: counted within the limit.
OUTPUT_LIMIT_NOTICE: Final = (
    "\n[qinglong: output reached the limit of {limit} bytes; the executor runs on and"
    " what it writes from here is discarded]\n"
)
#: How long the copy may still take, after the executor ended, for what is in the pipe.
RELAY_DRAIN_SECONDS: Final = 2.0
_RELAY_READ_BYTES: Final = 64 * 1024
_PR_SET_PDEATHSIG: Final = 1
#: Signals received so far: one that came before the executor existed is sent again
#: once it does (a stop is never lost to that race).
_received: list[int] = []


#: The mark of a Worker that lost its inbox (see the module's docstring).
LEASES_REVOKED_FILE: Final = "leases-revoked"
#: Set when a stop signal arrived while the mark existed.
_stopped_as_revoked: list[bool] = []


def status_file_name(pid: int, start_ticks: int) -> str:
    """The status file of the supervisor with this identity (shared with the Worker)."""
    return f"{pid}-{start_ticks}.json"


def launch_file_name(key: str) -> str:
    """The launch claim of one inbox record (shared with the Worker)."""
    if LAUNCH_KEY.match(key) is None:
        raise ValueError("not a launch key")
    return f"launch-{key}.json"


def lease_file_name(key: str) -> str:
    """Where the Worker writes the lease estimate of one launch (shared with the Worker)."""
    if LAUNCH_KEY.match(key) is None:
        raise ValueError("not a launch key")
    return f"lease-{key}.json"


def lease_document(expires_boot_ms: int, boot: str | None) -> dict[str, object]:
    """The local lease estimate: when it runs out on the boot clock of ``boot``."""
    return {"version": LEASE_VERSION, "boot": boot, "expires_boot_ms": expires_boot_ms}


def publish_lease(directory: str, key: str, expires_boot_ms: int, boot: str | None) -> None:
    """Replace the lease file at once (temp file and rename, not fsynced: its only
    reader, the supervisor, ends with the machine, and what a crashed Worker wrote stays
    in the page cache)."""
    _publish(directory, lease_file_name(key), lease_document(expires_boot_ms, boot), durable=False)


def read_lease_deadline(directory: str, key: str, boot: str | None) -> int | None:
    """When the lease written for ``key`` runs out on this boot's clock (0: already, as
    for an estimate made in another boot); None when there is no well-formed file."""
    try:
        with open(os.path.join(directory, lease_file_name(key)), "rb") as source:
            document = json.loads(source.read(4096))
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("version") != LEASE_VERSION:
        return None
    expires = document.get("expires_boot_ms")
    if not isinstance(expires, int) or isinstance(expires, bool):
        return None
    return expires if document.get("boot") == boot else 0


def boot_clock_ms() -> int:
    """Milliseconds since boot, suspend included; never steps (``CLOCK_BOOTTIME``)."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1_000_000


def launch_document(
    key: str, supervisor: str | None, answer: str | None, boot: str | None = None
) -> dict[str, object]:
    """``supervisor`` None: the launch was declared not started (by a restarted Worker).
    ``answer`` None: the supervisor claimed it and has not started the executor yet.
    ``boot``: the boot the supervisor runs in (its own field: a Worker of an earlier
    version compares ``supervisor`` as ``pid:…;start:…`` and must still find it)."""
    document: dict[str, object] = {
        "version": LAUNCH_VERSION,
        "launch": key,
        "supervisor": supervisor,
        "answer": answer,
    }
    if boot is not None:
        document["boot"] = boot
    return document


def claim_launch(directory: str, key: str, supervisor: str | None, boot: str | None = None) -> bool:
    """Create the launch claim; False if somebody claimed it first (nothing written)."""
    return _publish(
        directory,
        launch_file_name(key),
        launch_document(key, supervisor, None, boot),
        exclusive=True,
    )


def _own_start_ticks() -> int:
    with open("/proc/self/stat") as stat:
        text = stat.read()
    return int(text[text.rindex(")") + 2 :].split()[22 - 3])


#: The kernel's random id of the running boot. A PID and a start time name a process
#: only within one boot (start times count from it): an identity from an earlier boot
#: names nothing now, whatever runs under that PID (possible on a machine that boots the
#: same way each time).
_BOOT_ID_PATH: Final = "/proc/sys/kernel/random/boot_id"
#: ``pid:<pid>;start:<start ticks>[;boot:<boot id>]`` — the identity as text, which the
#: Worker records, reports as the executor handle and finds in claims and statuses.
_BOOT_ID: Final = r"[0-9a-f-]{36}"
HANDLE_PATTERN: Final = re.compile(
    rf"\Apid:([1-9][0-9]{{0,9}});start:([0-9]{{1,20}})(?:;boot:({_BOOT_ID}))?\Z"
)


def boot_id() -> str | None:
    """This boot's id; None where the kernel does not say."""
    try:
        with open(_BOOT_ID_PATH) as source:
            text = source.read().strip()
    except OSError:
        return None
    return text if is_boot_id(text) else None


def is_boot_id(text: str) -> bool:
    return re.fullmatch(_BOOT_ID, text) is not None


def handle_of(pid: int, start_ticks: int, boot: str | None) -> str:
    return f"pid:{pid};start:{start_ticks}" + (f";boot:{boot}" if boot else "")


def _forward(signal_number: int, _frame: FrameType | None) -> None:
    """A signal the supervisor received: noted, and sent to every other member."""
    _received.append(signal_number)
    if _status_dir and os.path.exists(os.path.join(_status_dir[0], LEASES_REVOKED_FILE)):
        _stopped_as_revoked.append(True)
    _signal_the_others(signal_number)


#: The status directory, once parsed (the signal handler looks for the mark there).
_status_dir: list[str] = []


def _signal_the_others(signal_number: int) -> None:
    """Send the signal once to every other member of the group.

    Ignoring it for the moment of the ``killpg`` discards the copy addressed to
    ourselves (an ignored signal is dropped when generated); the handler is restored
    right after, so a later signal is forwarded again.
    """
    signal.signal(signal_number, signal.SIG_IGN)
    try:
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp(), signal_number)
    finally:
        signal.signal(signal_number, _forward)


def _executor_preexec(libc: ctypes.CDLL | None, supervisor_pid: int) -> None:
    """In the executor, between fork and exec: default signal dispositions, and death
    with the supervisor."""
    for signal_number in FORWARDED_SIGNALS:
        signal.signal(signal_number, signal.SIG_DFL)
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    # The supervisor may have died before the prctl took effect: then die now.
    if os.getppid() != supervisor_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def _publish(
    directory: str,
    name: str,
    document: dict[str, object],
    *,
    exclusive: bool = False,
    durable: bool = True,
) -> bool:
    """Temp file, fsync, then rename (replace) or link (``exclusive``: only if ``name``
    does not exist yet), fsync of the directory: the document is there whole or not at
    all (``durable`` False: the same without the fsyncs, whole but not crash-proof).
    False only when ``exclusive`` found ``name`` taken."""
    payload = json.dumps(document, sort_keys=True).encode()
    # The pid and a nonce: the supervisor and a restarted Worker may race for one name.
    temporary = os.path.join(directory, f".{name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    descriptor = os.open(
        temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
    )
    try:
        if os.write(descriptor, payload) != len(payload):
            raise OSError(errno.ENOSPC, "short write")
        if durable:
            os.fsync(descriptor)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)  # a lease file is written often: leave no debris
        raise
    finally:
        os.close(descriptor)
    published = True
    try:
        if exclusive:
            try:
                os.link(temporary, os.path.join(directory, name))
            except FileExistsError:
                published = False
        else:
            os.rename(temporary, os.path.join(directory, name))
    finally:
        if exclusive:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
    if not durable:
        return published
    directory_descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(directory_descriptor)
    finally:
        os.close(directory_descriptor)
    return published


def _report(ready_fd: int, line: str) -> None:
    """Tell the Worker how the start went. A Worker killed meanwhile has closed the
    other end (EPIPE): the launch claim holds the answer for the one that restarts."""
    with contextlib.suppress(OSError):
        os.write(ready_fd, line.encode() + b"\n")
    with contextlib.suppress(OSError):
        os.close(ready_fd)


def _load_libc() -> ctypes.CDLL | None:
    # Loaded before the fork: dlopen between fork and exec is not safe.
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


class OutputRelay:
    """Copies the executor's output from ``source`` (a pipe's read end) to ``target`` (the
    log file) until the file holds ``limit`` bytes, then discards the rest (the module's
    "The output limit"). Runs on a thread of its own, woken by the pipe or by
    :meth:`finish` -- no timer."""

    def __init__(self, source: int, target: int, limit: int) -> None:
        self._source = source
        self._target = target
        self._notice = OUTPUT_LIMIT_NOTICE.format(limit=limit).encode()
        try:
            written = os.fstat(target).st_size
        except OSError:
            written = 0
        #: Bytes of output the file may still take before the notice; None: nothing
        #: more is written (past the limit, a file that failed, or one too full already
        #: for the notice, which is then left out rather than written past the limit).
        room = limit - written - len(self._notice)
        self._room: int | None = room if room >= 0 else None
        self._wake_read, self._wake_write = os.pipe()
        self._thread = threading.Thread(target=self._copy, name="output-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self, seconds: float = RELAY_DRAIN_SECONDS) -> bool:
        """Take what is in the pipe now, then stop (waiting at most ``seconds``); whether
        the copy ended in time."""
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"x")
        self._thread.join(seconds)
        return not self._thread.is_alive()

    def _copy(self) -> None:
        finishing = False
        while True:
            # Finishing: only what is there already (a background process the executor
            # left may hold the pipe open for ever).
            readable, _, _ = select.select(
                [self._source] if finishing else [self._source, self._wake_read],
                [],
                [],
                0 if finishing else None,
            )
            if self._wake_read in readable:
                finishing = True
                continue
            if not readable:
                return
            data = os.read(self._source, _RELAY_READ_BYTES)
            if not data:
                return  # every writer has closed the pipe
            self._keep(data)

    def _keep(self, data: bytes) -> None:
        if self._room is None:
            return  # past the limit, or the file failed: read and discarded
        kept = data[: self._room]
        self._room -= len(kept)
        try:
            _write_all(self._target, kept)
            if len(kept) < len(data):
                self._room = None
                _write_all(self._target, self._notice)
        except OSError:
            self._room = None


def _write_all(descriptor: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(descriptor, view) :]


_USAGE: Final = (
    "usage: supervisor.py --status-dir DIR --ready-fd N [--launch KEY] [--output-limit BYTES]"
    " -- ARGV...\n"
)
_OPTIONS: Final = ("--status-dir", "--ready-fd", "--launch", "--output-limit")


@dataclass(frozen=True)
class _Arguments:
    status_dir: str
    ready_fd: int
    launch: str | None
    output_limit: int | None
    command: list[str]


def _parse(argv: Sequence[str]) -> _Arguments | None:
    """The arguments; None if malformed."""
    options: dict[str, str] = {}
    index = 0
    while index < len(argv) and argv[index] != "--":
        name = argv[index]
        if name not in _OPTIONS or name in options or index + 1 >= len(argv):
            return None
        options[name] = argv[index + 1]
        index += 2
    command = list(argv[index + 1 :])
    launch = options.get("--launch")
    limit = options.get("--output-limit")
    if (
        not command
        or "--status-dir" not in options
        or not options.get("--ready-fd", "").isdigit()
        or (launch is not None and LAUNCH_KEY.match(launch) is None)
        or (limit is not None and not limit.isdigit())
    ):
        return None
    return _Arguments(
        options["--status-dir"],
        int(options["--ready-fd"]),
        launch,
        None if limit is None else int(limit),
        command,
    )


def _error_answer(error: BaseException) -> str:
    number = error.errno if isinstance(error, OSError) else None
    return f"error {number or 0} {type(error).__name__}"


def _claim(status_dir: str, key: str, handle: str, boot: str | None) -> str | None:
    """Claim the launch for this supervisor: None when won, else the answer to report."""
    try:
        if claim_launch(status_dir, key, handle, boot):
            return None
    except OSError as error:
        return _error_answer(error)  # not durable: then nothing may start
    return f"error {errno.EEXIST} {LAUNCH_FENCED}"


def run(argv: Sequence[str]) -> int:
    parsed = _parse(argv)
    if parsed is None:
        sys.stderr.write(_USAGE)
        return EXIT_USAGE
    status_dir, ready_fd, launch, command = (
        parsed.status_dir,
        parsed.ready_fd,
        parsed.launch,
        parsed.command,
    )
    _status_dir.append(status_dir)
    for signal_number in FORWARDED_SIGNALS:
        signal.signal(signal_number, _forward)
    own_pid = os.getpid()
    own_start = _own_start_ticks()
    handle, boot = handle_of(own_pid, own_start, None), boot_id()
    if launch is not None:
        refused = _claim(status_dir, launch, handle, boot)
        if refused is not None:
            _report(ready_fd, refused)
            return EXIT_NOT_STARTED
    libc = _load_libc()
    # Read before the executor starts, so that the watch holds from its first instant: the
    # Worker writes the file before the spawn, and may remove it (the record closed) before
    # a read after the start would come, which would leave the executor unwatched.
    first_deadline = None if launch is None else read_lease_deadline(status_dir, launch, boot)
    executor: subprocess.Popen[bytes] | None = None
    relay: OutputRelay | None = None
    output: int | None = None  # None: the executor inherits the supervisor's stdout/stderr
    try:
        if parsed.output_limit is not None:
            # Inside the try: with no descriptor left (EMFILE), the start failed, and the
            # Worker must hear why.
            relay_source, output = os.pipe()
            relay = OutputRelay(relay_source, sys.stdout.fileno(), parsed.output_limit)
        executor = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            close_fds=True,
            # The supervisor is single-threaded until the relay starts: preexec_fn is
            # safe here.
            preexec_fn=lambda: _executor_preexec(libc, own_pid),
        )
        answer = f"ok {executor.pid}"
    except (OSError, subprocess.SubprocessError) as error:
        answer = _error_answer(error)
    finally:
        if output is not None:
            os.close(output)  # the executor holds the write end: its end is the pipe's
    if relay is not None and executor is not None:
        _start_without_signals(relay)
    if launch is not None:
        try:
            claimed = launch_document(launch, handle, answer, boot)
            _publish(status_dir, launch_file_name(launch), claimed)
        except OSError as error:
            # A start that cannot be made durable does not run: a restarted Worker
            # would find this launch "claimed, no answer" and report it not started.
            _report(ready_fd, _error_answer(error))
            if executor is not None:
                os.killpg(os.getpgrp(), signal.SIGKILL)  # the executor's group, and us
            return EXIT_NOT_STARTED
    _report(ready_fd, answer)
    if executor is None:
        return EXIT_NOT_STARTED
    for early in dict.fromkeys(_received):
        _forward(early, None)
    code, lease_ran_out = _wait(executor, status_dir, launch, boot, first_deadline)
    if relay is not None:
        relay.finish()  # the file whole before the status says the executor ended
    lease_ran_out = lease_ran_out or bool(_stopped_as_revoked)
    document: dict[str, object] = {
        "version": STATUS_VERSION,
        "supervisor": handle,
        "boot": boot,
        "executor_pid": executor.pid,
        "exit_code": code if code >= 0 else None,
        "signal": -code if code < 0 else None,
        "finished_unix_ms": time.time_ns() // 1_000_000,
        "lease_ran_out": lease_ran_out,
    }
    try:
        _publish(status_dir, status_file_name(own_pid, own_start), document)
    except OSError as error:
        # Goes to the offer's log file; the Worker then sees no status (unobserved).
        sys.stderr.write(f"qinglong supervisor: exit status not recorded ({error.strerror})\n")
        return EXIT_STATUS_UNWRITTEN
    if launch is not None:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(status_dir, lease_file_name(launch)))  # of no use now
    os.killpg(os.getpgrp(), signal.SIGKILL)  # step 5: what the executor left, and us
    raise AssertionError("unreachable: the SIGKILL of our own group ended this process")


def _start_without_signals(relay: OutputRelay) -> None:
    """Start the relay's thread with every signal the supervisor waits for blocked in
    it (a thread inherits the mask it is created with): SIGCHLD must stay pending for
    ``sigtimedwait`` in the main thread, and a stop signal taken by the relay's thread
    would interrupt nothing the main thread waits in, so it would be forwarded late."""
    waited_for = {signal.SIGCHLD, *FORWARDED_SIGNALS}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, waited_for)
    try:
        relay.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _wait(
    executor: subprocess.Popen[bytes],
    status_dir: str,
    launch: str | None,
    boot: str | None,
    deadline: int | None,
) -> tuple[int, bool]:
    """Wait for the executor, watching its lease (``deadline``: as read before the
    start); its return code and whether the supervisor stopped it because the lease ran
    out (see the lease watch above)."""
    if launch is None:
        return executor.wait(), False
    # SIGCHLD, the executor's end, stays pending while blocked, for sigtimedwait. Blocked
    # only now: the executor was forked with the mask as it was, and keeps it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    kill_at: int | None = None
    while executor.poll() is None:
        now = boot_clock_ms()
        if kill_at is not None:  # stopping: TERM was sent
            if now >= kill_at:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(executor.pid, signal.SIGKILL)  # the rest of the group: step 5
            wait_ms = max(kill_at - now, 0) or int(LEASE_LOOK_SECONDS * 1000)
        else:
            written = read_lease_deadline(status_dir, launch, boot)
            # A file gone or unreadable keeps the last instant read from it.
            deadline = deadline if written is None else written
            if deadline is not None and now >= deadline:
                _signal_the_others(signal.SIGTERM)
                kill_at = now + int(LEASE_GONE_STOP_GRACE_SECONDS * 1000)
                wait_ms = kill_at - now
            else:
                look_ms = int(LEASE_LOOK_SECONDS * 1000)
                wait_ms = look_ms if deadline is None else min(deadline - now, look_ms)
        signal.sigtimedwait({signal.SIGCHLD}, max(wait_ms, 1) / 1000)
    return executor.wait(), kill_at is not None


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
