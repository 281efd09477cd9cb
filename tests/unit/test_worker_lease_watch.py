"""The supervisor's lease watch: an executor never outlives the lease its Worker last
wrote, whether or not a Worker is still alive (R-W-2 step 3 without a Worker).

Real processes: a stand-in Worker spawns the executor through the Worker's own
ProcessController and is then killed with SIGKILL, so the supervisor is nobody's child
here, exactly as after a Worker that never comes back. The lease file is written by the
function the Worker uses.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
from qinglong_worker import supervisor
from qinglong_worker.launch import launch_key
from qinglong_worker.process import ExitStatus, ProcessController, ProcessIdentity

from tests.support.polling import wait_until
from tests.support.worker_stand_in import spawn_then_lose_the_worker

KEY: Final = launch_key("offer-1", "attempt-1")
#: Liveness bounds, not timing claims: the machine may be loaded.
ENDED_SECONDS: Final = 30.0


@pytest.fixture
def status_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "exits"
    directory.mkdir(mode=0o700)
    yield directory
    for entry in Path("/proc").iterdir():  # whatever a test left running ends here
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if str(directory).encode() in (entry / "cmdline").read_bytes():
                    os.killpg(int(entry.name), signal.SIGKILL)


def _lease_for(status_dir: Path, seconds: float, boot: str | None = None) -> None:
    """Write the lease file as the Worker does: it runs out `seconds` from now."""
    supervisor.publish_lease(
        str(status_dir),
        KEY,
        supervisor.boot_clock_ms() + int(seconds * 1000),
        supervisor.boot_id() if boot is None else boot,
    )


def _spawn_then_lose_the_worker(status_dir: Path, argv: list[str]) -> ProcessIdentity:
    return spawn_then_lose_the_worker(status_dir, argv, KEY)


def _spawn_with_time_left(
    status_dir: Path, argv: list[str], ready: Path | None = None
) -> tuple[ProcessIdentity, float]:
    """Spawn under a lease that still has at least a second left once the executor runs
    (and has written `ready`, if given); the lease's end, on the monotonic clock.

    How long a spawn takes is the machine's to decide (over 2 s on a loaded 2-core
    machine): a lease the spawn outlasted is retried twice as long, rather than the test
    asserting about an executor already stopped."""
    seconds = 2.0
    while True:
        ends_at = time.monotonic() + seconds
        _lease_for(status_dir, seconds)
        identity = _spawn_then_lose_the_worker(status_dir, argv)
        if ready is not None:
            assert wait_until(ready.exists, ENDED_SECONDS, interval=0.02), "never ready"
        if ends_at - time.monotonic() >= 1.0:
            return identity, ends_at
        assert seconds < 60, "the spawn never fit in a minute's lease"
        os.killpg(identity.pid, signal.SIGKILL)
        _ended(identity, status_dir)
        if ready is not None:
            ready.unlink()
        seconds *= 2


def _ended(identity: ProcessIdentity, status_dir: Path) -> tuple[ExitStatus, float]:
    """How the executor ended, seen by a restarted Worker, and when (monotonic)."""
    restarted = ProcessController(status_dir=status_dir)
    found: list[ExitStatus] = []

    def ended() -> bool:
        status = restarted.poll(identity)
        if status is not None:
            found.append(status)
        return bool(found)

    assert wait_until(ended, ENDED_SECONDS, interval=0.02), "the executor ran on"
    return found[0], time.monotonic()


def _group_members(group: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == group and fields[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


def test_the_executor_of_a_worker_that_never_returns_is_stopped_when_its_lease_runs_out(
    status_dir: Path,
) -> None:
    _lease_for(status_dir, 1.0)
    began = time.monotonic()
    # A child in the background too: nothing of the group may run on without a lease.
    identity = _spawn_then_lose_the_worker(status_dir, ["sh", "-c", "sleep 300 & wait"])
    status, ended_at = _ended(identity, status_dir)
    assert status == ExitStatus(None, signal.SIGTERM, lease_ran_out=True)
    assert ended_at - began >= 1.0, "stopped before the lease ran out"
    assert _group_members(identity.pid) == []
    assert not (status_dir / supervisor.lease_file_name(KEY)).exists(), "removed at the end"


def test_a_lease_written_again_keeps_the_executor_running(status_dir: Path) -> None:
    identity, first_ends_at = _spawn_with_time_left(status_dir, ["sleep", "300"])
    renewed = time.monotonic()
    renewal_seconds = first_ends_at - renewed + 4.0  # ample beyond the look after the first
    _lease_for(status_dir, renewal_seconds)  # a renewal, as a live Worker writes it
    restarted = ProcessController(status_dir=status_dir)
    time.sleep(max(0.0, first_ends_at + 0.5 - time.monotonic()))  # past the first lease
    assert restarted.poll(identity) is None, "stopped although the lease was renewed"
    status, ended_at = _ended(identity, status_dir)
    assert status.lease_ran_out, "the renewed lease is watched too"
    assert ended_at - renewed >= renewal_seconds, "stopped before the renewed lease ran out"


def test_a_lease_file_that_went_away_keeps_the_last_lease_read(status_dir: Path) -> None:
    """Only a file never seen means "no watch" (an earlier Worker's supervisor): one that
    is removed or moved away later still ends the executor when the lease it said ends."""
    identity, ends_at = _spawn_with_time_left(status_dir, ["sleep", "300"])
    (status_dir / supervisor.lease_file_name(KEY)).unlink()
    status, ended_at = _ended(identity, status_dir)
    assert status == ExitStatus(None, signal.SIGTERM, lease_ran_out=True)
    assert ended_at >= ends_at


def test_an_executor_that_ignores_term_is_killed_after_the_lease_gone_grace(
    status_dir: Path,
) -> None:
    ready = status_dir.parent / "trapped"
    script = f"trap '' TERM; touch {ready}; sleep 300"
    identity, ends_at = _spawn_with_time_left(status_dir, ["sh", "-c", script], ready)
    status, ended_at = _ended(identity, status_dir)
    assert status == ExitStatus(None, signal.SIGKILL, lease_ran_out=True)
    assert ended_at - ends_at >= supervisor.LEASE_GONE_STOP_GRACE_SECONDS, "no TERM grace"
    assert _group_members(identity.pid) == [], "its sleep (TERM ignored) ended with the group"


def test_an_executor_that_ends_before_its_lease_keeps_its_own_ending(status_dir: Path) -> None:
    _lease_for(status_dir, 120.0)
    identity = _spawn_then_lose_the_worker(status_dir, ["sh", "-c", "sleep 0.3; exit 7"])
    status, _ = _ended(identity, status_dir)
    assert status == ExitStatus(7, None, lease_ran_out=False)


def test_without_a_lease_file_the_executor_is_waited_for_as_before(status_dir: Path) -> None:
    """A Worker of an earlier version writes none: nothing is stopped on a guess."""
    identity = _spawn_then_lose_the_worker(status_dir, ["sh", "-c", "sleep 1.5; exit 0"])
    status, _ = _ended(identity, status_dir)
    assert status == ExitStatus(0, None, lease_ran_out=False)


def test_a_lease_written_in_another_boot_has_run_out(status_dir: Path) -> None:
    _lease_for(status_dir, 120.0, boot="00000000-0000-0000-0000-000000000000")
    identity = _spawn_then_lose_the_worker(status_dir, ["sleep", "300"])
    status, _ = _ended(identity, status_dir)
    assert status == ExitStatus(None, signal.SIGTERM, lease_ran_out=True)


@pytest.mark.parametrize(
    "document",
    [b"", b"{", b"[]", b'{"version": 2, "boot": null, "expires_boot_ms": 0}', b'{"version": 1}'],
)
def test_a_lease_file_that_is_not_one_is_no_deadline(status_dir: Path, document: bytes) -> None:
    (status_dir / supervisor.lease_file_name(KEY)).write_bytes(document)
    assert supervisor.read_lease_deadline(str(status_dir), KEY, supervisor.boot_id()) is None
