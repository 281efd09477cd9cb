"""Replica evidence (SPEC §7 item 15, R-HA-1): `qinglong up --replicas 2`, two Workers,
a mixed load, and `kill -9` of one control and one ingress replica in the middle of it.

Worker A talks to ingress replica 0, Worker B (an identity of its own) to replica 1;
ingress replica i forwards to control replica i. Mid-load the test kills control replica
0 (ingress 0 loses its control) and ingress replica 1 (Worker B loses its front door);
`up`'s supervisor must start both again on the same addresses while the other replicas
keep serving. Afterwards every Run is terminal exactly once with the outcome its executor
really had, every event sequence is 1..n, no Event is duplicated, no command ran twice,
and both control replicas' reconcilers were running (their logs say what each did).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final, TypeVar

import grpc
import psycopg
import pytest
from qinglong_cli.pki import ensure_dev_pki, ensure_worker_identity, worker_uri
from qinglong_control.db.identities import enroll_worker
from qinglong_control.settings import ENV_RECONCILE_INTERVAL_SECONDS

from tests.support.devstack_process import DevStack, dev_stack
from tests.support.executor_marks import Marks, kill_leftovers, marked_command
from tests.support.fault_rig import UNSTARTABLE
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

SUCCEEDING: Final = 14
FAILING: Final = 8
UNSTARTABLE_RUNS: Final = 4
CANCELLED: Final = 4
#: Cancelled while still queued, before any Worker runs: only a reconciler can end them.
CONVERGED: Final = 6
CONCURRENCY: Final = 6
RESTART_SECONDS: Final = 30.0
RETRY_SECONDS: Final = 30.0
TERMINAL_SECONDS: Final = 120.0
_RECONCILED: Final = re.compile(
    r"reconciled: (\d+) leases expired, (\d+) runs converged, (\d+) blocked, "
    r"(\d+) retries scheduled, (\d+) exhausted, (\d+) requeued"
)

_T = TypeVar("_T")


@pytest.fixture
def stack(scratch: Path) -> Iterator[DevStack]:
    with dev_stack(
        scratch / "stack",
        # Short cadence: the reconcilers' work shows within the test's few seconds.
        environment={ENV_RECONCILE_INTERVAL_SECONDS: "0.5"},
        arguments=("--replicas", "2"),
    ) as up:
        yield up


def _retrying(call: Callable[[], _T]) -> _T:
    """An operator call retried while its ingress or control replica is restarting.
    Only calls whose repetition is harmless (reads, cancels) go through here."""
    deadline = time.monotonic() + RETRY_SECONDS
    while True:
        try:
            return call()
        except grpc.RpcError as error:
            if error.code() is not grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _second_worker(stack: DevStack, worker_id: str) -> tuple[str, ...]:
    """A second Worker identity from the stack's own dev CA, enrolled like `up` enrolls
    its Worker; returns the `qinglong-worker` flags that select it."""
    pki = ensure_dev_pki(stack.data_dir / "pki")
    tls = ensure_worker_identity(pki, worker_id)
    with psycopg.connect(stack.migration_url, autocommit=True) as conn:
        enroll_worker(conn, worker_id, worker_uri(pki.trust_domain, worker_id))
    return ("--worker-id", worker_id, "--tls-cert", str(tls.cert), "--tls-key", str(tls.key))


def _reconciler_work(log: Path) -> tuple[int, int]:
    """(cycles that did something, rows they changed) as one replica's log reports."""
    cycles = rows = 0
    for match in _RECONCILED.finditer(log.read_text(errors="replace") if log.exists() else ""):
        cycles += 1
        rows += sum(int(group) for group in match.groups())
    return cycles, rows


def test_two_replicas_each_survive_a_kill_mid_load(
    stack: DevStack, scratch: Path, report_tally: Callable[[Tally], None]
) -> None:
    ingress = stack.replicas("ingress")
    controls = stack.replicas("control")
    assert len(ingress) == len(controls) == 2
    assert ingress[0]["address"] == stack.ingress_address  # the single-replica keys remain

    marks = scratch / "executor-marks"
    workers = [
        WorkerProcess(
            stack,
            scratch / "worker-a" / "inbox.db",
            address=ingress[0]["address"],
            max_concurrency=CONCURRENCY,
        ),
        WorkerProcess(
            stack,
            scratch / "worker-b" / "inbox.db",
            address=ingress[1]["address"],
            max_concurrency=CONCURRENCY,
            extra_flags=_second_worker(stack, "replica-worker-b"),
        ),
    ]
    operator = OperatorClient(stack)
    expected: list[Expected] = []
    problems: list[str] = []
    try:
        # Spread over several reconcile ticks, so that both replicas' cycles get a chance
        # (SKIP LOCKED shares the rows; which replica takes each one is the race's).
        for index in range(CONVERGED):
            run_id = operator.trigger(["true"], name=f"converge-{index}")
            operator.cancel(run_id)
            expected.append(Expected(run_id, "cancelled", label=f"converge-{index}"))
            time.sleep(0.3)
        if not wait_until_terminal(stack.migration_url, [e.run_id for e in expected], 30):
            problems.append("the reconcilers did not converge the queued cancelled Runs")
        for worker in workers:
            worker.start()
        long_runs = []
        for index in range(SUCCEEDING + FAILING):
            exit_code = 0 if index % 3 else 3
            command = marked_command(marks, seconds=0.5 + (index % 4) * 0.5, exit_code=exit_code)
            run_id = operator.trigger(command, name=f"load-{index}")
            expected.append(
                Expected(
                    run_id,
                    "succeeded" if exit_code == 0 else "failed",
                    exit_code=exit_code,
                    label=f"load-{index}",
                )
            )
        for index in range(UNSTARTABLE_RUNS):
            run_id = operator.trigger(list(UNSTARTABLE), name=f"unstartable-{index}")
            expected.append(
                Expected(run_id, "failed", error_code="EXECUTOR_START_FAILED", label="unstartable")
            )
        for index in range(CANCELLED):
            run_id = operator.trigger(
                marked_command(marks, seconds=60, exit_code=0), name=f"cancel-{index}"
            )
            long_runs.append(run_id)
            expected.append(Expected(run_id, "cancelled", label=f"cancel-{index}"))

        # Mid-load: executors are running on both Workers.
        assert wait_until(lambda: sum(Marks.read(marks).counts().values()) >= 6, 60), (
            "the load never started:\n" + workers[0].log_tail() + "\n" + workers[1].log_tail()
        )
        victims = {"control": controls[0]["pid"], "ingress": ingress[1]["pid"]}
        for pid in victims.values():
            os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()

        def restarted() -> bool:
            now = {"control": stack.replicas("control")[0], "ingress": stack.replicas("ingress")[1]}
            return all(
                now[name]["restarts"] >= 1 and now[name]["pid"] != pid
                for name, pid in victims.items()
            )

        if not wait_until(restarted, RESTART_SECONDS):
            problems.append(f"the supervisor did not restart {victims} in {RESTART_SECONDS} s")
        restart_seconds = time.monotonic() - killed_at
        after = stack.reread()["replicas"]
        for name, index in (("control", 0), ("ingress", 1)):
            before_address = (controls if name == "control" else ingress)[index]["address"]
            if after[name][index]["address"] != before_address:
                problems.append(f"{name} replica {index} came back on another address")

        # Cancel the long Runs once they run (a queued one is converged by a reconciler).
        for run_id in long_runs:
            _retrying(lambda run_id=run_id: operator.cancel(run_id))

        if not wait_until_terminal(
            stack.migration_url, [e.run_id for e in expected], TERMINAL_SECONDS
        ):
            problems.append(f"not every Run was terminal after {TERMINAL_SECONDS:.0f} s")
        if not stack.running():
            problems.append("qinglong up exited after a replica was killed")
    finally:
        statuses = [worker.stop() for worker in workers]
        operator.close()
        kill_leftovers(marks)
    problems += [
        f"Worker {i} exited {status} on SIGINT" for i, status in enumerate(statuses) if status
    ]

    tally = compute_tally(
        "2 control + 2 ingress, kill -9 one of each",
        stack.migration_url,
        expected,
        executions=Marks.read(marks).counts(),
        extra_faults=2,
    )
    tally.notes.append(f"supervisor restarted both killed replicas within {restart_seconds:.1f} s")
    total_rows = 0
    for entry in stack.replicas("control"):
        cycles, rows = _reconciler_work(Path(entry["log"]))
        total_rows += rows
        tally.notes.append(
            f"reconciler {Path(entry['log']).name}: {cycles} productive cycles, {rows} rows"
        )
    if total_rows < CONVERGED:
        problems.append(f"the reconcilers' logs account for {total_rows} rows, not {CONVERGED}")
    report_tally(tally)
    if problems or not tally.clean:
        problems += [f"worker {i} log tail:\n{w.log_tail()}" for i, w in enumerate(workers)]
    assert_verdict(tally, problems)
