"""SIGTERM drain (issue 7).

A Worker told to leave drains: it tells control (DrainSession), takes no new work, lets
a short job finish and report ``succeeded``, and stops a job that outlives the drain
grace, reporting it cancelled for shutdown, so that its Run ends ``cancelled`` rather
than being abandoned to lease expiry (worker_service.proto, CompleteAttemptRequest
``stop_reason``: SHUTDOWN). Only then does it exit 0.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Final

import psycopg

from tests.support.fault_rig import FaultRig
from tests.support.fault_tally import Expected, Tally, assert_verdict
from tests.support.polling import wait_until
from tests.support.worker_process import WorkerProcess

#: The Worker flag bounding how long a draining Worker lets its executors run
#: (clients/worker settings). A Worker without it refuses to start, and this test says so.
DRAIN_GRACE_FLAG: Final = "--drain-grace-seconds"
DRAIN_GRACE_SECONDS: Final = 6.0
SHORT_SECONDS: Final = 3.0
RUNNING_SECONDS: Final = 30.0
EXIT_SECONDS: Final = 60.0
CONVERGE_SECONDS: Final = 45.0


def _run_row(migration_url: str, run_id: str) -> tuple[str, int, str | None]:
    with psycopg.connect(migration_url, connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT state, attempt_count, cancel_reason FROM qinglong.runs WHERE run_id = %s",
            (run_id,),
        ).fetchone()
    assert row is not None
    return str(row[0]), int(row[1]), None if row[2] is None else str(row[2])


def _drain(rig: FaultRig, worker: WorkerProcess, short: Expected, long: Expected) -> list[str]:
    """SIGTERM with both executors running; what went wrong."""
    worker.signal(signal.SIGTERM)
    # Work that arrives while the Worker drains is not its any more.
    late = rig.trigger("late", seconds=1, exit_code=0)

    problems: list[str] = []
    status = worker.wait(EXIT_SECONDS)
    if status is None:
        problems.append(f"the draining Worker had not exited after {EXIT_SECONDS:.0f} s")
        worker.kill9()
        worker.wait()
    elif status != 0:
        problems.append(f"the Worker exited {status} after SIGTERM, not 0")
    if rig.schedule.calls["DrainSession"] == 0:
        problems.append("the Worker never called DrainSession")
    if rig.live_executors():
        problems.append(f"executors outlived the drained Worker: {rig.live_executors()}")
    late_state, late_attempts, _ = _run_row(rig.stack.migration_url, late.run_id)
    if late_attempts != 0:
        problems.append(f"the draining Worker claimed a new Run ({late_state})")
    # Nobody else will take it: cancel it, and expect exactly that.
    rig.operator.cancel(late.run_id)
    rig.expect(Expected(late.run_id, "cancelled", label="late"))

    if not rig.wait_terminal(CONVERGE_SECONDS):
        problems.append(f"not every Run was terminal after {CONVERGE_SECONDS:.0f} s")
    long_state, _, long_reason = _run_row(rig.stack.migration_url, long.run_id)
    if long_state == "cancelled" and long_reason != "shutdown":
        problems.append(f"the long Run was cancelled for {long_reason}, not shutdown")
    finished = rig.read_marks().of(short.run_id)
    if not finished or finished[0].exit_code != 0:
        problems.append("the short job did not finish on its own during the drain")
    return problems


def test_sigterm_drains_short_job_succeeds_long_job_cancelled(
    rig: FaultRig, report_tally: Callable[[Tally], None]
) -> None:
    worker = rig.worker(
        max_concurrency=2, extra_flags=(DRAIN_GRACE_FLAG, str(DRAIN_GRACE_SECONDS))
    ).start()
    short = rig.trigger("short", seconds=SHORT_SECONDS, exit_code=0)
    long = rig.trigger("long", seconds=120, exit_code=0)
    rig.expect(Expected(long.run_id, "cancelled", label="long"))

    problems: list[str] = []
    if wait_until(lambda: len(rig.live_executors()) == 2, RUNNING_SECONDS):
        problems += _drain(rig, worker, short, long)
    else:
        status = worker.process.poll() if worker.process is not None else None
        problems.append(f"two executors never ran (the Worker's exit status: {status})")

    tally = rig.tally("SIGTERM drain", extra_faults=1)
    report_tally(tally)
    if problems or not tally.clean:
        problems.append("worker log tail:\n" + worker.log_tail())
    assert_verdict(tally, problems)
