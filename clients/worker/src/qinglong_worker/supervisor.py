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
   stderr inherited (the Worker's per-offer log file), and ``PR_SET_PDEATHSIG=SIGKILL``
   so that the executor dies with its supervisor — a SIGKILL of the supervisor alone
   never leaves an orphan running without a lease;
3. reports ``ok <pid>`` (or ``error <errno> <kind>`` when the exec failed) on the
   ready descriptor, so that the Worker learns synchronously whether the start worked;
4. waits for the executor and writes its exit status durably as
   ``<status dir>/<own pid>-<own start ticks>.json`` (temp file, fsync, rename, fsync
   of the directory), named by the supervisor's own identity, which is the identity the
   Worker records, supervises and stops (SPEC R-W-3);
5. exits 0 (3: the executor could not be started; 4: the status could not be written).

The supervisor is not tied to the Worker's lifetime: it is not in the Worker's process
group and holds no parent-death signal, so it survives a Worker crash and a restarted
Worker reads the status it left.

Stopping (by the Worker, after verifying PID + start time): SIGTERM to the supervisor
alone is forwarded once to every other member of its group (the executor and what it
started); SIGKILL goes to the whole group, so nothing survives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import Final

STATUS_VERSION: Final = 1
EXIT_RECORDED: Final = 0
EXIT_USAGE: Final = 2
EXIT_NOT_STARTED: Final = 3
EXIT_STATUS_UNWRITTEN: Final = 4
FORWARDED_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG: Final = 1
#: Signals received so far: one that came before the executor existed is sent again
#: once it does (a stop is never lost to that race).
_received: list[int] = []


def status_file_name(pid: int, start_ticks: int) -> str:
    """The status file of the supervisor with this identity (shared with the Worker)."""
    return f"{pid}-{start_ticks}.json"


def _own_start_ticks() -> int:
    with open("/proc/self/stat") as stat:
        text = stat.read()
    return int(text[text.rindex(")") + 2 :].split()[22 - 3])


def _forward(signal_number: int, _frame: FrameType | None) -> None:
    """Send the signal once to every other member of the group.

    Ignoring it for the moment of the ``killpg`` discards the copy addressed to
    ourselves (an ignored signal is dropped when generated); the handler is restored
    right after, so a later signal is forwarded again.
    """
    _received.append(signal_number)
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


def _write_status(directory: str, name: str, document: dict[str, object]) -> None:
    """Temp file, fsync, rename, fsync of the directory: the status is there or not at all."""
    payload = json.dumps(document, sort_keys=True).encode()
    temporary = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    descriptor = os.open(
        temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
    )
    try:
        os.write(descriptor, payload)
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    os.rename(temporary, os.path.join(directory, name))
    directory_descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(directory_descriptor)
    finally:
        os.close(directory_descriptor)


def _report(ready_fd: int, line: str) -> None:
    try:
        os.write(ready_fd, line.encode() + b"\n")
    finally:
        os.close(ready_fd)


def _load_libc() -> ctypes.CDLL | None:
    # Loaded before the fork: dlopen between fork and exec is not safe.
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def run(argv: Sequence[str]) -> int:
    if len(argv) < 6 or argv[0] != "--status-dir" or argv[2] != "--ready-fd" or argv[4] != "--":
        sys.stderr.write("usage: supervisor.py --status-dir DIR --ready-fd N -- ARGV...\n")
        return EXIT_USAGE
    status_dir, ready_fd, command = argv[1], int(argv[3]), list(argv[5:])
    for signal_number in FORWARDED_SIGNALS:
        signal.signal(signal_number, _forward)
    own_pid = os.getpid()
    own_start = _own_start_ticks()
    libc = _load_libc()
    try:
        executor = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            close_fds=True,
            # The supervisor is single-threaded: preexec_fn is safe here.
            preexec_fn=lambda: _executor_preexec(libc, own_pid),
        )
    except OSError as error:
        _report(ready_fd, f"error {error.errno or 0} {type(error).__name__}")
        return EXIT_NOT_STARTED
    except subprocess.SubprocessError as error:
        _report(ready_fd, f"error 0 {type(error).__name__}")
        return EXIT_NOT_STARTED
    _report(ready_fd, f"ok {executor.pid}")
    for early in dict.fromkeys(_received):
        _forward(early, None)
    code = executor.wait()
    document: dict[str, object] = {
        "version": STATUS_VERSION,
        "supervisor": f"pid:{own_pid};start:{own_start}",
        "executor_pid": executor.pid,
        "exit_code": code if code >= 0 else None,
        "signal": -code if code < 0 else None,
        "finished_unix_ms": time.time_ns() // 1_000_000,
    }
    try:
        _write_status(status_dir, status_file_name(own_pid, own_start), document)
    except OSError as error:
        # Goes to the offer's log file; the Worker then sees no status (unobserved).
        sys.stderr.write(f"qinglong supervisor: exit status not recorded ({error.strerror})\n")
        return EXIT_STATUS_UNWRITTEN
    return EXIT_RECORDED


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
