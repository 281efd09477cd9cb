"""A promotion in the middle of a load (SPEC §7 item 14, R-HA-2): a real Worker runs 30
Runs (50 under ``make soak``, which sets ``QINGLONG_SOAK_RUNS``), successes and failures
of different lengths, through ingress; once executors are running, the control backends
are terminated, the old primary is fenced and the synchronous standby promoted. The
Worker retries through the UNAVAILABLE window and gets replay answers; afterwards every
Run is terminal exactly once with the outcome its executor really had, and no command
ran twice (the executors' own marks).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import pytest
from qinglong_control.settings import ENV_RECONCILE_INTERVAL_SECONDS

from tests.support.devstack_process import DevStack, dev_stack
from tests.support.executor_marks import Marks, kill_leftovers, marked_command
from tests.support.failover_probe import on_promoted_standby, promote_standby
from tests.support.fault_tally import (
    Expected,
    Tally,
    assert_verdict,
    compute_tally,
    wait_until_terminal,
)
from tests.support.operator_client import OperatorClient
from tests.support.polling import wait_until
from tests.support.worker_process import WorkerProcess

#: 30 in `make test`; 50 when a soak size is set (`make soak`: QINGLONG_SOAK_RUNS=300).
RUNS: Final = 50 if os.environ.get("QINGLONG_SOAK_RUNS") else 30
CONCURRENCY: Final = 6
#: Executors started before the promotion: the load is well under way, far from done.
STARTED_BEFORE_PROMOTION: Final = 8
TERMINAL_SECONDS: Final = 120.0


@pytest.fixture
def stack(scratch: Path) -> Iterator[DevStack]:
    with dev_stack(
        scratch / "stack",
        environment={ENV_RECONCILE_INTERVAL_SECONDS: "1"},
        arguments=("--standby", "--postgres-version", "18"),
    ) as up:
        yield up


def test_promotion_mid_load_loses_and_repeats_nothing(
    stack: DevStack, scratch: Path, report_tally: Callable[[Tally], None]
) -> None:
    marks = scratch / "executor-marks"
    worker = WorkerProcess(
        stack,
        scratch / "worker" / "inbox.db",
        address=stack.ingress_address,
        max_concurrency=CONCURRENCY,
    )
    operator = OperatorClient(stack)
    expected: list[Expected] = []
    problems: list[str] = []
    started_before = finished_before = terminated = 0
    drained = float("nan")
    try:
        for index in range(RUNS):
            exit_code = 0 if index % 4 else 5
            command = marked_command(marks, seconds=0.3 + (index % 5) * 0.3, exit_code=exit_code)
            run_id = operator.trigger(command, name=f"load-{index}")
            expected.append(
                Expected(
                    run_id,
                    "succeeded" if exit_code == 0 else "failed",
                    exit_code=exit_code,
                    label=f"load-{index}",
                )
            )
        worker.start()
        assert wait_until(
            lambda: sum(Marks.read(marks).counts().values()) >= STARTED_BEFORE_PROMOTION, 60
        ), "the load never started:\n" + worker.log_tail()
        before = Marks.read(marks)
        started_before = sum(before.counts().values())
        finished_before = sum(
            1
            for found in before.executions.values()
            for execution in found
            if execution.exit_code is not None
        )
        promotion = promote_standby(stack)
        terminated = promotion.terminated

        if not wait_until_terminal(
            stack.migration_url, [e.run_id for e in expected], TERMINAL_SECONDS
        ):
            problems.append(f"not every Run was terminal after {TERMINAL_SECONDS:.0f} s")
        drained = time.monotonic() - promotion.promoted_at
        problems += on_promoted_standby(stack)
        restarts = [e["restarts"] for kind in ("control", "ingress") for e in stack.replicas(kind)]
        if any(restarts):
            problems.append(f"a service had to be restarted to fail over: {restarts}")
    finally:
        status = worker.stop()
        operator.close()
        kill_leftovers(marks)
    if status:
        problems.append(f"the Worker exited {status} on SIGINT")

    tally = compute_tally(
        f"promote the synchronous standby mid-load ({RUNS} Runs, real Worker)",
        stack.migration_url,
        expected,
        executions=Marks.read(marks).counts(),
        extra_calls=3 * RUNS,  # the operator's CreateTask, CreateTaskRevision, TriggerRun
        extra_faults=2,  # the backend kill and the promotion
    )
    tally.notes.append(
        f"promoted with {started_before} executors started, {finished_before} finished; "
        f"{terminated} control backends terminated; all Runs ended {drained:.1f} s later"
    )
    report_tally(tally)
    if problems or not tally.clean:
        problems.append("worker log tail:\n" + worker.log_tail())
    assert_verdict(tally, problems)
