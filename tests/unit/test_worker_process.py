"""The local process controller (SPEC R-W-3, R-TO-2) with real subprocesses: identity by PID
plus start time, TERM then KILL of a verified identity only, exit status without blocking,
and the executor's fail-closed timing variables."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from qinglong_worker import process
from qinglong_worker.process import (
    DEADLINE_ENV,
    LOST_WITH_SUPERVISOR,
    TIMEOUT_ENV,
    UNOBSERVED_EXIT,
    UNREADABLE_STATUS_SECONDS,
    ExecutorRefused,
    ExitStatus,
    ProcessController,
    ProcessIdentity,
    StopResult,
    check_timing_environment,
    parse_status_document,
    read_start_ticks,
    timing_environment,
)
from qinglong_worker.supervisor import status_file_name

from tests.support.polling import wait_until
from tests.support.worker_stand_in import spawn_then_lose_the_worker

DEADLINE = 1_900_000_000_000


def spawned(controller: ProcessController, argv: list[str], **options: Any) -> ProcessIdentity:
    """Start ``argv`` through the Worker's own spawn (asynchronous), from a test that
    runs no event loop."""
    return asyncio.run(controller.spawn_async(argv, **options))


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[ProcessController]:
    processes = ProcessController(
        base_environment={"PATH": os.environ["PATH"], "QINGLONG_WORKER_TLS_KEY": "/secret"},
        status_dir=tmp_path / "exits",
    )
    started: list[ProcessIdentity] = []
    original = processes.spawn_async

    async def tracking_spawn(*args: object, **kwargs: object) -> ProcessIdentity:
        identity = await original(*args, **kwargs)  # type: ignore[arg-type]
        started.append(identity)
        return identity

    processes.spawn_async = tracking_spawn  # type: ignore[method-assign]
    yield processes
    for identity in started:  # never leave a test process behind
        if processes.poll(identity) is None:
            os.kill(identity.pid, signal.SIGKILL)
            _wait_for_exit(processes, identity)


def _wait_for_exit(
    processes: ProcessController, identity: ProcessIdentity, seconds: float = 10.0
) -> ExitStatus:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        status = processes.poll(identity)
        if status is not None:
            return status
        time.sleep(0.01)
    raise AssertionError("the process did not exit")


def _wait_for_file(path: Path, seconds: float = 10.0) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.01)
    raise AssertionError(f"{path} was not written")


def _finished_process() -> subprocess.Popen[bytes]:
    process = subprocess.Popen(["true"])
    process.wait()
    return process


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "30"], start_new_session=True)


def _exists(pid: int) -> bool:
    """Anything at all (a zombie too) at `pid`."""
    return Path(f"/proc/{pid}").exists()


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


def test_identity_is_pid_plus_start_time_and_the_handle_is_bounded(
    controller: ProcessController,
) -> None:
    identity = spawned(controller, ["sleep", "30"], timeout_ms=None, deadline_unix_ms=None)
    fields = Path(f"/proc/{identity.pid}/stat").read_text().rsplit(")", 1)[1].split()
    assert identity.start_ticks == int(fields[22 - 3]) == read_start_ticks(identity.pid)
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert identity.boot_id == boot
    assert identity.handle == f"pid:{identity.pid};start:{identity.start_ticks};boot:{boot}"
    assert len(identity.handle.encode()) <= 512
    assert ProcessIdentity.from_handle(identity.handle) == identity
    with pytest.raises(ValueError, match="handle"):
        ProcessIdentity.from_handle("pid:1")
    # Its own session and process group: a signal to the Worker's group never reaches it.
    assert os.getsid(identity.pid) == identity.pid == os.getpgid(identity.pid)
    assert controller.poll(identity) is None


def test_exit_status_is_reaped_without_blocking(
    controller: ProcessController, tmp_path: Path
) -> None:
    # It ends only once told to (a file appears): a poll that waited for it would never
    # come back to tell it.
    go = tmp_path / "go"
    script = f'while [ ! -e "{go}" ]; do sleep 0.01; done; exit 3'
    identity = spawned(controller, ["sh", "-c", script], timeout_ms=None, deadline_unix_ms=None)
    assert controller.poll(identity) is None
    go.touch()
    assert _wait_for_exit(controller, identity) == ExitStatus(3, None)
    assert not _exists(identity.pid), "reaped, not a zombie"
    controller.release(identity)


def test_argv_runs_without_a_shell(controller: ProcessController, tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    identity = spawned(
        controller,
        ["printf", "%s", "$(id); echo injected"],
        timeout_ms=None,
        deadline_unix_ms=None,
        log_path=log,
    )
    assert _wait_for_exit(controller, identity) == ExitStatus(0, None)
    assert log.read_text() == "$(id); echo injected"
    assert log.stat().st_mode & 0o077 == 0


async def test_stop_sends_term_to_the_verified_identity(controller: ProcessController) -> None:
    identity = await controller.spawn_async(["sleep", "30"], timeout_ms=None, deadline_unix_ms=None)
    started = time.monotonic()
    assert await controller.stop(identity, grace_seconds=5.0) is StopResult.STOPPED
    assert time.monotonic() - started < 2.0, "TERM was enough; no wait for the grace"
    assert not _exists(identity.pid), "stopped and reaped, not a zombie"
    assert controller.poll(identity) == ExitStatus(None, signal.SIGTERM)


async def test_stop_kills_a_process_that_ignores_term(
    controller: ProcessController, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    # An ignored signal stays ignored across exec: this `sleep` ignores SIGTERM.
    identity = await controller.spawn_async(
        ["sh", "-c", f"trap '' TERM; echo ready > {ready}; exec sleep 30"],
        timeout_ms=None,
        deadline_unix_ms=None,
    )
    _wait_for_file(ready)
    started = time.monotonic()
    assert await controller.stop(identity, grace_seconds=0.4) is StopResult.STOPPED
    elapsed = time.monotonic() - started
    assert 0.4 <= elapsed < 5.0
    assert not _exists(identity.pid)
    assert controller.poll(identity) == ExitStatus(None, signal.SIGKILL)


async def test_stop_of_an_exited_process_reports_already_exited(
    controller: ProcessController,
) -> None:
    identity = await controller.spawn_async(
        ["sh", "-c", "exit 3"], timeout_ms=None, deadline_unix_ms=None
    )
    _wait_for_exit(controller, identity)
    assert await controller.stop(identity, grace_seconds=0.1) is StopResult.ALREADY_EXITED
    # A process that is not our child (e.g. started before a Worker restart) and is gone.
    gone = _finished_process()
    stranger = ProcessIdentity(gone.pid, 12345)
    assert await ProcessController().stop(stranger) is StopResult.ALREADY_EXITED
    assert ProcessController().poll(stranger) == LOST_WITH_SUPERVISOR


async def test_a_reused_pid_is_never_signalled() -> None:
    """An identity whose start time differs names another process: ours has ended (a
    restarted Worker reports it so, rather than as unconfirmed), and the other one is
    never signalled."""
    other = _sleeper()
    try:
        real = ProcessIdentity(other.pid, read_start_ticks(other.pid))
        reused = ProcessIdentity(other.pid, real.start_ticks + 1)
        processes = ProcessController()
        assert await processes.stop(reused, grace_seconds=0.1) is StopResult.ALREADY_EXITED
        await asyncio.sleep(0.2)
        assert other.poll() is None
        assert _alive(other.pid), "nothing was signalled"
        # Whatever runs at that PID now, the process we knew has ended.
        assert processes.poll(reused) == LOST_WITH_SUPERVISOR
        # The same controller does stop the verified identity of a process it did not
        # spawn (a restarted Worker finds its executor by the durable handle).
        assert processes.poll(real) is None
        assert await processes.stop(real, grace_seconds=5.0) is StopResult.STOPPED
        assert other.wait(timeout=5) == -signal.SIGTERM
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()


def test_executor_gets_timeout_and_deadline_and_not_the_workers_settings(
    controller: ProcessController, tmp_path: Path
) -> None:
    log = tmp_path / "env.log"
    identity = spawned(
        controller,
        ["sh", "-c", f'echo "${TIMEOUT_ENV} ${DEADLINE_ENV} ${{QINGLONG_WORKER_TLS_KEY:-none}}"'],
        timeout_ms=60_000,
        deadline_unix_ms=DEADLINE,
        extra_environment={TIMEOUT_ENV: "1", "QINGLONG_RUN_ID": "r"},
        log_path=log,
    )
    assert _wait_for_exit(controller, identity) == ExitStatus(0, None)
    assert log.read_text().split() == ["60000", str(DEADLINE), "none"]
    identity = spawned(controller, ["sh", "-c", "exit 0"], timeout_ms=None, deadline_unix_ms=None)
    assert _wait_for_exit(controller, identity) == ExitStatus(0, None)


@pytest.mark.parametrize(
    "environment",
    [
        {TIMEOUT_ENV: "60000"},  # one-sided
        {DEADLINE_ENV: str(DEADLINE)},  # one-sided
        {TIMEOUT_ENV: "-1", DEADLINE_ENV: str(DEADLINE)},  # negative
        {TIMEOUT_ENV: "60000", DEADLINE_ENV: "-5"},
        {TIMEOUT_ENV: "1.5", DEADLINE_ENV: str(DEADLINE)},  # not an integer
        {TIMEOUT_ENV: "60000", DEADLINE_ENV: "1e12"},
        {TIMEOUT_ENV: " 60000", DEADLINE_ENV: str(DEADLINE)},
        {TIMEOUT_ENV: "+60000", DEADLINE_ENV: str(DEADLINE)},
        {TIMEOUT_ENV: "", DEADLINE_ENV: ""},
        {TIMEOUT_ENV: "0", DEADLINE_ENV: str(DEADLINE)},  # out of range
        {TIMEOUT_ENV: "604800001", DEADLINE_ENV: str(DEADLINE)},
        {TIMEOUT_ENV: "60000", DEADLINE_ENV: "9007199254740992"},  # not a safe integer
    ],
)
def test_timing_variables_fail_closed(environment: dict[str, str]) -> None:
    with pytest.raises(ExecutorRefused):
        check_timing_environment(environment)


def test_timing_variables_that_are_accepted() -> None:
    assert check_timing_environment({}) == (None, None)
    assert check_timing_environment({TIMEOUT_ENV: "60000", DEADLINE_ENV: str(DEADLINE)}) == (
        60_000,
        DEADLINE,
    )
    assert timing_environment(None, None) == {}


def test_a_one_sided_or_negative_plan_refuses_to_start(
    controller: ProcessController, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    argv = ["sh", "-c", f"touch {marker}"]
    for timeout_ms, deadline in ((60_000, None), (None, DEADLINE), (-1, DEADLINE), (1, -1)):
        with pytest.raises(ExecutorRefused):
            spawned(controller, argv, timeout_ms=timeout_ms, deadline_unix_ms=deadline)
    with pytest.raises(ExecutorRefused):
        spawned(controller, [], timeout_ms=None, deadline_unix_ms=None)
    time.sleep(0.1)
    assert not marker.exists(), "nothing was started"


# --- the supervisor: exit statuses that outlive the Worker -------------------------------------


#: A stand-in for a Worker process: it spawns one executor and waits to be killed.
def _spawn_in_a_worker_then_kill_it(status_dir: Path, argv: list[str]) -> ProcessIdentity:
    return spawn_then_lose_the_worker(status_dir, argv)


def _children_of(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(child) for child in text.split()]


def _group_members(group: int) -> list[int]:
    """Live processes whose process group is `group`."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[2]) == group and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _poll_until_ended(processes: ProcessController, identity: ProcessIdentity) -> ExitStatus:
    status = _wait_for_exit(processes, identity)
    assert status is not None
    return status


@pytest.fixture
def status_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "exits"
    yield directory
    # Whatever a test left running under this directory's supervisors ends here.
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if str(directory).encode() in (entry / "cmdline").read_bytes():
                    os.killpg(int(entry.name), signal.SIGKILL)


@pytest.mark.parametrize("code", [0, 7])
def test_an_exit_status_survives_the_worker_that_spawned_it(status_dir: Path, code: int) -> None:
    identity = _spawn_in_a_worker_then_kill_it(status_dir, ["sh", "-c", f"sleep 0.3; exit {code}"])
    # A restarted Worker: a new controller, not the supervisor's parent.
    restarted = ProcessController(status_dir=status_dir)
    assert restarted.poll(identity) is None, "the supervisor outlived its Worker"
    assert _poll_until_ended(restarted, identity) == ExitStatus(code, None)
    status_file = status_dir / status_file_name(identity.pid, identity.start_ticks)
    assert status_file.stat().st_mode & 0o777 == 0o600
    restarted.release(identity)
    assert not status_file.exists(), "released once the inbox holds the status"


async def test_a_restarted_worker_stops_an_executor_and_learns_how_it_ended(
    status_dir: Path,
) -> None:
    identity = _spawn_in_a_worker_then_kill_it(status_dir, ["sleep", "30"])
    restarted = ProcessController(status_dir=status_dir)
    assert await restarted.stop(identity, grace_seconds=5.0) is StopResult.STOPPED
    assert _poll_until_ended(restarted, identity) == ExitStatus(None, signal.SIGTERM)


async def test_term_reaches_each_process_of_the_group_once_and_kill_leaves_none(
    controller: ProcessController, tmp_path: Path
) -> None:
    terms, ready = tmp_path / "terms", tmp_path / "ready"
    script = f"trap 'echo term >> {terms}' TERM; echo ready > {ready}; while :; do sleep 0.05; done"
    identity = await controller.spawn_async(
        ["sh", "-c", script], timeout_ms=None, deadline_unix_ms=None
    )
    _wait_for_file(ready)
    assert len(_group_members(identity.pid)) >= 2, "the executor runs in the supervisor's group"
    # The script survives SIGTERM (its trap only notes it): SIGKILL ends it after the grace,
    # which leaves the trap time to run even on a loaded machine.
    assert await controller.stop(identity, grace_seconds=1.5) is StopResult.STOPPED
    noted = terms.read_text() if terms.exists() else ""
    assert noted == "term\n", f"SIGTERM was forwarded exactly once, not {noted!r}"
    # A SIGKILLed member can linger in /proc for a moment after stop() returns; it must go.
    assert wait_until(lambda: _group_members(identity.pid) == [], 5), "SIGKILL took the group"
    assert controller.poll(identity) == ExitStatus(None, signal.SIGKILL)


def test_killing_the_supervisor_alone_takes_its_executor_with_it(
    controller: ProcessController,
) -> None:
    identity = spawned(controller, ["sleep", "30"], timeout_ms=None, deadline_unix_ms=None)
    deadline = time.monotonic() + 5
    while not (executors := _children_of(identity.pid)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(executors) == 1
    os.kill(identity.pid, signal.SIGKILL)  # not the group: the supervisor only
    deadline = time.monotonic() + 5
    while _alive(executors[0]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive(executors[0]), "the executor died with its supervisor (no orphan)"
    # Killed by someone else, it says nothing of how the executor would have ended.
    assert _poll_until_ended(controller, identity) == LOST_WITH_SUPERVISOR


def test_a_start_that_fails_is_reported_at_once_and_leaves_nothing(
    controller: ProcessController, tmp_path: Path
) -> None:
    with pytest.raises(FileNotFoundError):
        spawned(controller, ["/nonexistent/binary"], timeout_ms=None, deadline_unix_ms=None)
    not_executable = tmp_path / "script"
    not_executable.write_text("#!/bin/sh\n")
    with pytest.raises(PermissionError):
        spawned(controller, [str(not_executable)], timeout_ms=None, deadline_unix_ms=None)
    assert controller.known() == frozenset()


async def test_stop_all_stops_every_remembered_identity(controller: ProcessController) -> None:
    first = await controller.spawn_async(["sleep", "30"], timeout_ms=None, deadline_unix_ms=None)
    second = await controller.spawn_async(["sleep", "30"], timeout_ms=None, deadline_unix_ms=None)
    finished = await controller.spawn_async(["true"], timeout_ms=None, deadline_unix_ms=None)
    _wait_for_exit(controller, finished)
    results = await controller.stop_all(grace_seconds=2.0)
    assert results == {first: StopResult.STOPPED, second: StopResult.STOPPED}
    assert controller.poll(first) == controller.poll(second) == ExitStatus(None, signal.SIGTERM)


def test_a_status_document_must_name_its_identity_and_one_ending() -> None:
    identity = ProcessIdentity(1234, 99)

    def document(**fields: object) -> bytes:
        return json.dumps({"version": 1, "supervisor": identity.handle, **fields}).encode()

    assert parse_status_document(document(exit_code=3, signal=None), identity) == ExitStatus(
        3, None
    )
    assert parse_status_document(document(exit_code=None, signal=9), identity) == ExitStatus(
        None, 9
    )
    other = ProcessIdentity(1234, 100)
    assert parse_status_document(document(exit_code=0, signal=None), other) is None
    for bad in (
        document(exit_code=3, signal=9),
        document(exit_code=None, signal=None),
        document(exit_code=256, signal=None),
        document(exit_code="0", signal=None),
        b"not json",
        b"[]",
    ):
        assert parse_status_document(bad, identity) is None


BOOT_A, BOOT_B = "a" * 8 + "-0000-0000-0000-" + "a" * 12, "b" * 8 + "-0000-0000-0000-" + "b" * 12


def test_a_status_document_names_the_boot_beside_the_handle_every_version_reads() -> None:
    """`supervisor` stays `pid:…;start:…` (what a Worker of an earlier version compares);
    the boot is its own field, compared when both the document and the identity name one."""
    booted = ProcessIdentity(1234, 99, BOOT_A)

    def document(**fields: object) -> bytes:
        ended = {"version": 1, "supervisor": "pid:1234;start:99", "exit_code": 0, "signal": None}
        return json.dumps({**ended, **fields}).encode()

    assert parse_status_document(document(boot=BOOT_A), booted) == ExitStatus(0, None)
    assert parse_status_document(document(boot=BOOT_B), booted) is None, "another boot's"
    assert parse_status_document(document(), booted) == ExitStatus(0, None)  # an older one's
    unknown = ProcessIdentity(1234, 99)
    assert parse_status_document(document(boot=BOOT_B), unknown) == ExitStatus(0, None)
    assert parse_status_document(document(supervisor=booted.handle), booted) is None


def test_a_status_that_cannot_be_read_is_unobserved_not_a_kill(
    controller: ProcessController,
) -> None:
    """Every supervisor ends itself by SIGKILL once its status is written: when that status
    is unreadable, its SIGKILL says nothing of how the executor ended."""
    status_dir = controller.status_dir
    assert status_dir is not None
    identity = spawned(controller, ["sleep", "0.3"], timeout_ms=None, deadline_unix_ms=None)
    status_file = status_dir / status_file_name(identity.pid, identity.start_ticks)
    assert wait_until(status_file.exists, 10), "the supervisor wrote no status"
    status_file.write_text("{broken")
    # Polled through the Worker that spawned it: the supervisor's own exit, a SIGKILL of
    # its group, is known here — and says nothing of how the executor ended.
    assert _poll_until_ended(controller, identity) == UNOBSERVED_EXIT


def test_a_status_unreadable_for_a_moment_is_read_again_not_given_up(
    controller: ProcessController,
) -> None:
    """A status that cannot be read just now (EMFILE, EIO; here a directory where the
    file goes) leaves the ending undecided, and the next poll reads the real one: a
    passing fault must not turn a Run's exit 7 into "not observable"."""
    status_dir = controller.status_dir
    assert status_dir is not None
    identity = spawned(controller, ["sh", "-c", "exit 7"], timeout_ms=None, deadline_unix_ms=None)
    status_file = status_dir / status_file_name(identity.pid, identity.start_ticks)
    assert wait_until(status_file.exists, 10), "the supervisor wrote no status"
    assert wait_until(lambda: not _alive(identity.pid), 10)
    aside = status_file.with_name("aside")
    status_file.rename(aside)
    status_file.mkdir()
    assert controller.poll(identity) is None, "undecided while its status cannot be read"
    status_file.rmdir()
    aside.rename(status_file)
    assert controller.poll(identity) == ExitStatus(7, None)


def test_a_status_unreadable_is_waited_for_by_time_not_by_polls(tmp_path: Path) -> None:
    """Polls come every tick: a fault that lasts a few seconds (EMFILE while the daemon
    is short of descriptors) outlasted ten polls, and a Run's exit 0 was reported "not
    observable". The ending stays undecided for UNREADABLE_STATUS_SECONDS however many
    polls find the status unreadable, and only then is given up."""
    now = [1000.0]
    controller = ProcessController(status_dir=tmp_path / "exits", clock=lambda: now[0])
    (tmp_path / "exits").mkdir()
    identity = spawned(controller, ["sh", "-c", "exit 0"], timeout_ms=None, deadline_unix_ms=None)
    status_file = tmp_path / "exits" / status_file_name(identity.pid, identity.start_ticks)
    assert wait_until(status_file.exists, 10), "the supervisor wrote no status"
    assert wait_until(lambda: not _alive(identity.pid), 10)
    aside = status_file.with_name("aside")
    status_file.rename(aside)
    status_file.mkdir()  # EISDIR on every read, as EMFILE would be
    for _ in range(50):
        assert controller.poll(identity) is None
    now[0] += UNREADABLE_STATUS_SECONDS - 1
    assert controller.poll(identity) is None
    now[0] += 2
    assert controller.poll(identity) == UNOBSERVED_EXIT


def test_what_an_executor_leaves_running_ends_with_it(
    controller: ProcessController, tmp_path: Path
) -> None:
    """A background process the executor did not wait for has no lease once the Attempt
    ended: it goes with the supervisor's group, after the exit status is recorded."""
    left = tmp_path / "left.pid"
    script = f"sleep 300 & echo $! > {left}; exit 3"
    identity = spawned(controller, ["sh", "-c", script], timeout_ms=None, deadline_unix_ms=None)
    assert _poll_until_ended(controller, identity) == ExitStatus(3, None)
    _wait_for_file(left)
    background = int(left.read_text())
    assert wait_until(lambda: not _alive(background), 5), "the background sleep outlived the run"


async def test_an_identity_from_an_earlier_boot_names_nothing_now(
    controller: ProcessController,
) -> None:
    """A PID and start time name a process only within one boot: after a reboot, a record
    whose executor happens to have the PID and start time of a process running now (a
    machine that boots the same way each time) must not take that process for it — it is
    never signalled, and the executor is known to have ended."""
    identity = await controller.spawn_async(["sleep", "30"], timeout_ms=None, deadline_unix_ms=None)
    assert identity.boot_id is not None
    earlier = ProcessIdentity(identity.pid, identity.start_ticks, BOOT_A)
    restarted = ProcessController()
    assert restarted.poll(earlier) == LOST_WITH_SUPERVISOR  # it ended with its boot
    assert await restarted.stop(earlier, grace_seconds=0.1) is StopResult.ALREADY_EXITED
    assert _alive(identity.pid), "the process running now was not signalled"
    # An identity recorded before Workers recorded the boot is probed as before.
    unknown = ProcessIdentity(identity.pid, identity.start_ticks)
    assert restarted.poll(unknown) is None
    assert ProcessIdentity.from_handle(earlier.handle) == earlier


# --- the spawn never blocks the event loop ---------------------------------------------------

#: How long the slow supervisor takes before it starts (the real one answers in ~20 ms;
#: a slow disk under its launch claim's fsyncs makes it seconds).
SLOW_START_SECONDS = 1.0


def _slow_supervisor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seconds: float = SLOW_START_SECONDS
) -> None:
    """Every spawn runs, as its supervisor, a program that sleeps ``seconds`` and then is
    the real supervisor (same process: same identity, ready descriptor and launch claim).
    The seam is ``process.SUPERVISOR_SCRIPT``, the one program every spawn runs: a real
    process that is slow to answer, without a test hook in the supervisor itself."""
    script = tmp_path / "slow_supervisor.py"
    script.write_text(
        "import runpy, sys, time\n"
        f"time.sleep({seconds!r})\n"
        f"sys.argv[0] = {str(process.SUPERVISOR_SCRIPT)!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    monkeypatch.setattr(process, "SUPERVISOR_SCRIPT", script)


class _Ticker:
    """A coroutine that ticks every 10 ms and remembers the longest gap between ticks:
    how long the event loop was held up."""

    def __init__(self) -> None:
        self.ticks = 0
        self.longest_gap = 0.0
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            self.ticks += 1
            self.longest_gap = max(self.longest_gap, now - last)
            last = now

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def test_a_slow_supervisor_does_not_hold_up_the_event_loop(
    controller: ProcessController, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait for the supervisor's answer is on the loop: lease control, session
    renewal and the local-lease check of every other Run go on while it lasts."""
    _slow_supervisor(tmp_path, monkeypatch)
    ticker = _Ticker()
    await asyncio.sleep(0.05)
    started = time.monotonic()
    try:
        identity = await controller.spawn_async(
            ["sleep", "30"], timeout_ms=None, deadline_unix_ms=None, launch_key="ab" * 16
        )
    finally:
        await ticker.stop()
    try:
        assert time.monotonic() - started >= SLOW_START_SECONDS, "the supervisor was slow"
        assert ticker.ticks >= 30, "the other coroutine kept running during the spawn"
        assert ticker.longest_gap < 0.3, f"the loop was held up {ticker.longest_gap:.2f} s"
        assert controller.known() == frozenset({identity})
        assert controller.poll(identity) is None
        assert identity.start_ticks == read_start_ticks(identity.pid)
    finally:
        assert await controller.stop(identity, grace_seconds=0.0) is StopResult.STOPPED


async def test_a_supervisor_that_never_answers_times_out_without_holding_up_the_loop(
    controller: ProcessController, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spawn gives up after the ready timeout (here shortened), kills the
    supervisor's group and reaps it, polling on the loop: nothing is left, not even a
    zombie, and the loop was never held up."""
    _slow_supervisor(tmp_path, monkeypatch, seconds=60.0)
    monkeypatch.setattr(process, "_READY_TIMEOUT_SECONDS", 0.5)
    ticker = _Ticker()
    before = set(_children_of(os.getpid()))
    try:
        with pytest.raises(TimeoutError, match="did not report its start"):
            await controller.spawn_async(["sleep", "30"], timeout_ms=None, deadline_unix_ms=None)
    finally:
        await ticker.stop()
    assert ticker.longest_gap < 0.3, f"the loop was held up {ticker.longest_gap:.2f} s"
    assert set(_children_of(os.getpid())) <= before, "the supervisor was killed and reaped"
    assert controller.known() == frozenset()


async def test_a_cancelled_spawn_leaves_nothing_running(
    controller: ProcessController, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while it waits for the supervisor, the spawn kills the supervisor's
    group (before it could start the executor) and reaps it: nothing is left running."""
    _slow_supervisor(tmp_path, monkeypatch)
    marker = tmp_path / "ran"
    before = set(_children_of(os.getpid()))
    spawn = asyncio.create_task(
        controller.spawn_async(
            ["sh", "-c", f"touch {marker}; sleep 30"], timeout_ms=None, deadline_unix_ms=None
        )
    )
    await asyncio.sleep(0.2)
    assert set(_children_of(os.getpid())) - before, "the supervisor is forked"
    spawn.cancel()
    with pytest.raises(asyncio.CancelledError):
        await spawn
    assert set(_children_of(os.getpid())) <= before, "the supervisor was killed and reaped"
    await asyncio.sleep(SLOW_START_SECONDS)
    assert not marker.exists(), "no executor ever started"
    assert controller.known() == frozenset()


async def test_a_stopped_process_is_remembered_as_signalled_until_released(
    controller: ProcessController,
) -> None:
    """The Worker tells a stop it sent from an exit of the process's own by this memory
    (reconcile._ended_by_itself); released with the process, it does not grow for ever."""
    identity = await controller.spawn_async(["sleep", "30"], timeout_ms=None, deadline_unix_ms=None)
    assert not controller.signalled(identity)
    assert await controller.stop(identity, grace_seconds=2.0) is StopResult.STOPPED
    assert controller.signalled(identity)
    assert controller.poll(identity) == ExitStatus(None, signal.SIGTERM)
    controller.release(identity)
    assert not controller.signalled(identity)


#: A child whose main thread ends while another lives on for a second: its leader is a
#: zombie in /proc that cannot be reaped yet (what a supervisor with its output relay
#: thread looks like for an instant as it ends). It ignores SIGTERM, so a stop waits.
_LEADER_ENDS_FIRST = """
import ctypes, os, signal, sys, threading, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
def last_thread():
    time.sleep(1.0)
    os._exit(0)
threading.Thread(target=last_thread).start()
sys.stdout.write("ready\\n"); sys.stdout.flush()
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_child_is_not_taken_as_ended_before_it_can_be_reaped(tmp_path: Path) -> None:
    controller = ProcessController(status_dir=tmp_path / "exits")
    child = subprocess.Popen(
        [sys.executable, "-c", _LEADER_ENDS_FIRST], stdout=subprocess.PIPE, start_new_session=True
    )
    assert child.stdout is not None
    with child.stdout:
        assert child.stdout.readline() == b"ready\n"
    identity = ProcessIdentity(child.pid, read_start_ticks(child.pid), None)
    controller._spawned(identity, child)
    assert wait_until(lambda: _state(child.pid) == "Z", 5.0), "the main thread ended"
    assert child.poll() is None, "the leader is a zombie, the process not reapable yet"
    # Not ended while a thread of it lives: for a child of this Worker as for a supervisor
    # adopted after a restart (which may still be writing the output file).
    assert process._probe(identity).value == "running"
    assert controller.poll(identity) is None
    assert asyncio.run(controller.stop(identity, grace_seconds=30.0)) is StopResult.STOPPED
    assert child.returncode == 0, "stopped means reaped: its last thread ended it"
    assert not _exists(child.pid)
