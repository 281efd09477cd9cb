"""Inbox corruption while an executor runs (issue 7).

The inbox is the Worker's only durable memory of what it owns (SPEC R-W-1). Once it is
garbage the Worker can no longer prove any fence, so it must not carry on: the daemon
exits non-zero naming the file, and the executor it started is stopped, because nothing
may run without a lease it can still present. Started again on the corrupt file, it
refuses to start. The Run is not lost either: control's expiry authority turns the
abandoned Attempt ``lost`` and, with no retry policy, ends the Run ``failed`` with
ATTEMPTS_EXHAUSTED (SPEC B-EXP, R-RETRY-2).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

from tests.support.fault_rig import FaultRig
from tests.support.fault_tally import Expected, Tally, assert_verdict
from tests.support.polling import wait_until

RUNNING_SECONDS: Final = 30.0
EXIT_SECONDS: Final = 30.0
#: The Worker's stop grace is 2 s (FAST_FLAGS); this leaves room for TERM, then KILL.
EXECUTOR_GONE_SECONDS: Final = 15.0
#: One lease lifetime (30 s) after the last renewal, plus reconcile cycles.
CONVERGE_SECONDS: Final = 60.0


def _overwrite_with_garbage(path: Path) -> None:
    """Overwrite the file's bytes in place (same inode, same size, at least one page)."""
    size = max(path.stat().st_size, 4096)
    with path.open("r+b") as stream:
        stream.write(os.urandom(size))
        stream.flush()
        os.fsync(stream.fileno())


def _corrupt_inbox(inbox: Path) -> list[Path]:
    # The database file alone is not enough: in WAL mode SQLite may keep serving pages
    # from its write-ahead log and index. The inbox is all three files; garble each.
    files = [path for path in (inbox, Path(f"{inbox}-wal"), Path(f"{inbox}-shm")) if path.exists()]
    for path in files:
        _overwrite_with_garbage(path)
    return files


def test_a_corrupt_inbox_stops_the_worker_and_its_executor(
    rig: FaultRig, report_tally: Callable[[Tally], None]
) -> None:
    worker = rig.worker(max_concurrency=1).start()
    run = rig.trigger("long", seconds=120, exit_code=0)
    # Its executor is stopped by the Worker, never finishing on its own.
    rig.expect(Expected(run.run_id, "failed", error_code="ATTEMPTS_EXHAUSTED", label="long"))

    problems: list[str] = []
    started = wait_until(
        lambda: bool(rig.read_marks().of(run.run_id)) and bool(rig.live_executors()),
        RUNNING_SECONDS,
    )
    assert started, "the executor never started:\n" + worker.log_tail()
    # Let the Worker persist `running_acknowledged` and renew a few times first: the
    # scenario is a corrupt inbox under a running Attempt, not one still starting.
    if not wait_until(lambda: rig.schedule.calls["ControlLease"] >= 2, RUNNING_SECONDS):
        problems.append("the Worker never renewed the running Attempt's lease twice")
    log_before = len(worker.log_text())
    corrupted = _corrupt_inbox(rig.inbox)

    status = worker.wait(EXIT_SECONDS)
    if status is None:
        problems.append(f"the Worker kept running {EXIT_SECONDS:.0f} s on a corrupt inbox")
        worker.kill9()
        worker.wait()
    elif status == 0:
        problems.append("the Worker exited 0 on a corrupt inbox")
    if str(rig.inbox) not in worker.log_text()[log_before:]:
        problems.append(f"the Worker's log does not name {rig.inbox}")
    if not wait_until(lambda: not rig.live_executors(), EXECUTOR_GONE_SECONDS):
        problems.append(f"the executor still runs without a Worker: {rig.live_executors()}")

    # Restarted on the corrupt file, it must refuse: nothing may be pulled or claimed.
    calls_before = sum(rig.schedule.calls.values())
    log_before = len(worker.log_text())
    worker.start()
    restarted = worker.wait(EXIT_SECONDS)
    if restarted is None or restarted == 0:
        problems.append(f"restarted on the corrupt inbox, the Worker did not fail ({restarted})")
        worker.stop()
    if str(rig.inbox) not in worker.log_text()[log_before:]:
        problems.append(f"restarted, the Worker's log does not name {rig.inbox}")
    if sum(rig.schedule.calls.values()) != calls_before:
        problems.append("restarted on a corrupt inbox, the Worker still called ingress")

    if not rig.wait_terminal(CONVERGE_SECONDS):
        problems.append(f"the Run was not terminal after {CONVERGE_SECONDS:.0f} s")
    tally = rig.tally("inbox corruption", extra_faults=len(corrupted))
    report_tally(tally)
    if problems or not tally.clean:
        problems.append("worker log tail:\n" + worker.log_tail())
    assert_verdict(tally, problems)
