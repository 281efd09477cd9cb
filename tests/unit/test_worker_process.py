"""The local process controller (SPEC R-W-3, R-TO-2) with real subprocesses: identity by PID
plus start time, TERM then KILL of a verified identity only, exit status without blocking,
and the executor's fail-closed timing variables."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from qinglong_worker.process import (
    DEADLINE_ENV,
    TIMEOUT_ENV,
    UNOBSERVED_EXIT,
    ExecutorRefused,
    ExitStatus,
    ProcessController,
    ProcessIdentity,
    StopResult,
    check_timing_environment,
    read_start_ticks,
    timing_environment,
)

DEADLINE = 1_900_000_000_000


@pytest.fixture
def controller() -> Iterator[ProcessController]:
    processes = ProcessController(
        base_environment={"PATH": os.environ["PATH"], "QINGLONG_WORKER_TLS_KEY": "/secret"}
    )
    spawned: list[ProcessIdentity] = []
    original = processes.spawn

    def tracking_spawn(*args: object, **kwargs: object) -> ProcessIdentity:
        identity = original(*args, **kwargs)  # type: ignore[arg-type]
        spawned.append(identity)
        return identity

    processes.spawn = tracking_spawn  # type: ignore[method-assign]
    yield processes
    for identity in spawned:  # never leave a test process behind
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


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_identity_is_pid_plus_start_time_and_the_handle_is_bounded(
    controller: ProcessController,
) -> None:
    identity = controller.spawn(["sleep", "30"], timeout_ms=None, deadline_unix_ms=None)
    fields = Path(f"/proc/{identity.pid}/stat").read_text().rsplit(")", 1)[1].split()
    assert identity.start_ticks == int(fields[22 - 3]) == read_start_ticks(identity.pid)
    assert identity.handle == f"pid:{identity.pid};start:{identity.start_ticks}"
    assert len(identity.handle.encode()) <= 512
    assert ProcessIdentity.from_handle(identity.handle) == identity
    with pytest.raises(ValueError, match="handle"):
        ProcessIdentity.from_handle("pid:1")
    # Its own session and process group: a signal to the Worker's group never reaches it.
    assert os.getsid(identity.pid) == identity.pid == os.getpgid(identity.pid)
    assert controller.poll(identity) is None


def test_exit_status_is_reaped_without_blocking(controller: ProcessController) -> None:
    identity = controller.spawn(["sh", "-c", "exit 3"], timeout_ms=None, deadline_unix_ms=None)
    started = time.monotonic()
    first = controller.poll(identity)
    assert time.monotonic() - started < 0.5  # poll never waits for the process
    assert first in (None, ExitStatus(3, None))
    assert _wait_for_exit(controller, identity) == ExitStatus(3, None)
    assert not _exists(identity.pid), "reaped, not a zombie"
    controller.release(identity)


def test_argv_runs_without_a_shell(controller: ProcessController, tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    identity = controller.spawn(
        ["printf", "%s", "$(id); echo injected"],
        timeout_ms=None,
        deadline_unix_ms=None,
        log_path=log,
    )
    assert _wait_for_exit(controller, identity) == ExitStatus(0, None)
    assert log.read_text() == "$(id); echo injected"
    assert log.stat().st_mode & 0o077 == 0


async def test_stop_sends_term_to_the_verified_identity(controller: ProcessController) -> None:
    identity = controller.spawn(["sleep", "30"], timeout_ms=None, deadline_unix_ms=None)
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
    identity = controller.spawn(
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
    identity = controller.spawn(["sh", "-c", "exit 3"], timeout_ms=None, deadline_unix_ms=None)
    _wait_for_exit(controller, identity)
    assert await controller.stop(identity, grace_seconds=0.1) is StopResult.ALREADY_EXITED
    # A process that is not our child (e.g. started before a Worker restart) and is gone.
    gone = _finished_process()
    stranger = ProcessIdentity(gone.pid, 12345)
    assert await ProcessController().stop(stranger) is StopResult.ALREADY_EXITED
    assert ProcessController().poll(stranger) == UNOBSERVED_EXIT


async def test_a_reused_pid_is_never_signalled() -> None:
    """An identity whose start time differs names another process: unverified, untouched."""
    other = _sleeper()
    try:
        real = ProcessIdentity(other.pid, read_start_ticks(other.pid))
        reused = ProcessIdentity(other.pid, real.start_ticks + 1)
        processes = ProcessController()
        assert await processes.stop(reused, grace_seconds=0.1) is StopResult.UNVERIFIED
        await asyncio.sleep(0.2)
        assert other.poll() is None
        assert _alive(other.pid), "nothing was signalled"
        # Whatever runs at that PID now, the process we knew has ended.
        assert processes.poll(reused) == UNOBSERVED_EXIT
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
    identity = controller.spawn(
        ["sh", "-c", f'echo "${TIMEOUT_ENV} ${DEADLINE_ENV} ${{QINGLONG_WORKER_TLS_KEY:-none}}"'],
        timeout_ms=60_000,
        deadline_unix_ms=DEADLINE,
        extra_environment={TIMEOUT_ENV: "1", "QINGLONG_RUN_ID": "r"},
        log_path=log,
    )
    assert _wait_for_exit(controller, identity) == ExitStatus(0, None)
    assert log.read_text().split() == ["60000", str(DEADLINE), "none"]
    identity = controller.spawn(["sh", "-c", "exit 0"], timeout_ms=None, deadline_unix_ms=None)
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
            controller.spawn(argv, timeout_ms=timeout_ms, deadline_unix_ms=deadline)
    with pytest.raises(ExecutorRefused):
        controller.spawn([], timeout_ms=None, deadline_unix_ms=None)
    time.sleep(0.1)
    assert not marker.exists(), "nothing was started"
