"""A Worker killed with kill -9 that never comes back: its executor must not run on
beside the retry the control plane starts elsewhere (nothing runs twice).

Real processes only: `qinglong up` with a short lease (4 s) and a short Worker stop bound
(8 s, so a lost Attempt's retry is due 8 s after its lease expired), a `qinglong-worker
run` behind the lossy proxy, and the Run's executors as real processes that mark when
they start. The proxy kills the first Worker as it sends its second ControlLease; that
Worker is never started again. A second Worker — another inbox on another volume, the
same identity — takes the retry. The first executor's supervisor, left alone with no
Worker, must stop it when the lease it was last given runs out, before the retry starts.

The second scenario is a container restart: the Worker and every supervisor are killed
at once (a container's processes die together), and the Worker starts again on the same
inbox. The executor died with its supervisor, leaving no exit status: the Attempt must
end `lost` — retried by the policy — never `failed` as if the task had failed.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import psycopg
import pytest
from qinglong.rpc.v1 import execution_pb2

from tests.support.devstack_process import DevStack
from tests.support.executor_marks import is_alive
from tests.support.fault_rig import FaultRig, fault_stack
from tests.support.fault_tally import Expected, Tally
from tests.support.lossy_proxy import Phase, act_at
from tests.support.polling import wait_until
from tests.support.worker_process import WorkerProcess

LEASE_TTL_MS: Final = 4_000
WORKER_STOP_MS: Final = 8_000
KILL_SECONDS: Final = 30.0
#: Liveness: the retry is due about 4 + 1 + 8 s after the kill; the second run takes 1 s.
CONVERGE_SECONDS: Final = 60.0
POLL_SECONDS: Final = 0.05


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    """This module's own stack: a lease of a few seconds, a Worker stop bound of 8."""
    with fault_stack({"lease_ttl_ms": LEASE_TTL_MS, "worker_stop_ms": WORKER_STOP_MS}) as up:
        yield up


def first_runs_long_then_retries_end(marks: Path) -> list[str]:
    """The first execution of a Run sleeps for ten minutes; any later one ends at once."""
    target = shlex.quote(str(marks))
    ids = '"$QINGLONG_RUN_ID" "${QINGLONG_ATTEMPT_ID:-none}" "$$"'
    script = (
        f'if grep -q "^start $QINGLONG_RUN_ID " {target} 2>/dev/null;'
        " then seconds=1; else seconds=600; fi; "
        f"echo start {ids} >> {target}; "
        'sleep "$seconds"; '
        f"echo end {ids} 0 >> {target}"
    )
    return ["sh", "-c", script]


def _retried_run(rig: FaultRig, label: str) -> str:
    """A Run of that command whose policy retries once, at once: its first execution is
    lost, the retry must end it `succeeded`."""
    retry = execution_pb2.RetryPolicy(
        max_attempts=2, initial_backoff_ms=1, max_backoff_ms=1, backoff_multiplier_percent=100
    )
    command = first_runs_long_then_retries_end(rig.marks)
    run_id = rig.operator.trigger(command, name=label.replace(" ", "-"), retry=retry)
    rig.expected.append(Expected(run_id, "succeeded", exit_code=0, max_started=2, label=label))
    return run_id


def test_the_executor_of_a_worker_that_never_returns_ends_before_its_retry_starts(
    rig: FaultRig, report_tally: Callable[[Tally], None]
) -> None:
    first = rig.worker(max_concurrency=1)
    killed = threading.Event()

    def kill() -> None:
        first.kill9()
        killed.set()

    rig.schedule.add(act_at("ControlLease", Phase.REQUEST, kill, call=2))
    run_id = _retried_run(rig, "never returns")
    first.start()

    problems: list[str] = []
    first_ended_after = second_started_after = None
    second = WorkerProcess(
        rig.stack, rig.directory / "second" / "inbox.db", address=rig.proxy.address
    )
    rig.workers.append(second)
    if not killed.wait(KILL_SECONDS):
        problems.append("the first Worker never reached its second ControlLease")
    elif first.wait() is None:
        problems.append("the first Worker survived kill -9")
    elif not rig.read_marks().of(run_id):
        problems.append("the first executor had not started when its Worker was killed")
    else:
        killed_at = time.monotonic()
        [execution] = rig.read_marks().of(run_id)
        second.start()  # the first Worker is never started again
        deadline = killed_at + CONVERGE_SECONDS
        while time.monotonic() < deadline and second_started_after is None:
            now = time.monotonic() - killed_at
            if first_ended_after is None and not is_alive(execution.pid):
                first_ended_after = now
            if len(rig.read_marks().of(run_id)) > 1:
                second_started_after = now
            time.sleep(POLL_SECONDS)
        if second_started_after is None:
            problems.append("the retry never started on the second Worker")
        if first_ended_after is None:
            problems.append("the first executor ran on with no Worker and no lease")
        elif second_started_after is not None and first_ended_after >= second_started_after:
            problems.append("the first executor still ran when the retry started")
        if not rig.wait_terminal(CONVERGE_SECONDS):
            problems.append("the Run was not terminal after the retry")
    status = second.stop()

    def seconds(value: float | None) -> str:
        return "never" if value is None else f"{value:.1f} s"

    overlapping = first_ended_after is None or (
        second_started_after is not None and first_ended_after >= second_started_after
    )
    line = (
        f"worker never returns: first executor ended {seconds(first_ended_after)} after the"
        f" kill, the retry started {seconds(second_started_after)} after it; executions"
        f" {len(rig.read_marks().of(run_id))}, overlapping executions {int(overlapping)}"
    )
    tally = rig.noted_tally("kill -9, never restarted", line, report_tally, extra_faults=0)
    rig.assert_restarted_worker_verdict(tally, problems, second, status)


def _supervisors_of(status_dir: Path) -> list[int]:
    """The supervisors whose status directory is `status_dir` (their argv names it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--status-dir" in argv and str(status_dir).encode() in argv:
                found.append(int(entry.name))
    return found


def _attempt_states(migration_url: str, run_id: str) -> list[str]:
    with psycopg.connect(migration_url, connect_timeout=5) as conn:
        rows = conn.execute(
            "SELECT state FROM qinglong.attempts WHERE run_id = %s ORDER BY attempt_number",
            (run_id,),
        ).fetchall()
    return [str(state) for (state,) in rows]


def test_a_container_restart_loses_the_execution_and_the_policy_retries_it(
    rig: FaultRig, report_tally: Callable[[Tally], None]
) -> None:
    worker = rig.worker(max_concurrency=1)
    run_id = _retried_run(rig, "container restart")
    worker.start()
    problems: list[str] = []
    status_dir = rig.inbox.parent / "exits"
    if not wait_until(lambda: bool(rig.read_marks().of(run_id)), KILL_SECONDS):
        problems.append("the first execution never started")
    else:
        supervisors = _supervisors_of(status_dir)
        worker.kill9()  # the container's processes die together
        for pid in supervisors:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if worker.wait() is None:
            problems.append("the Worker survived kill -9")
        if not supervisors:
            problems.append("no supervisor found to kill")
        worker.start()  # the restarted container, on the same volume
        if not rig.wait_terminal(CONVERGE_SECONDS):
            problems.append("the Run was not terminal after the restart")
    status = worker.stop()
    states = _attempt_states(rig.stack.migration_url, run_id)
    if states != ["lost", "succeeded"]:
        problems.append(f"attempts ended {states}, not lost then succeeded")
    line = f"container restart: attempts {states}, executions {len(rig.read_marks().of(run_id))}"
    tally = rig.noted_tally("container restart", line, report_tally, extra_faults=0)
    rig.assert_restarted_worker_verdict(tally, problems, worker, status)
