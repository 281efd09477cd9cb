"""Replica evidence (SPEC §7 item 15, R-HA-1): `qinglong up --replicas 2`, three Workers
(each its own enrolled identity), a mixed load, and kill -9 of a Worker, of one control
and of one ingress replica in the middle of it.

Workers A and C talk to ingress replica 0, Worker B to replica 1; every ingress replica
reaches both control replicas (round robin). The load mixes successes, failures,
unstartable commands, user cancels (sent once the executor runs), timeouts (a
`timeout_ms` far shorter than the executor's sleep: the Run must end ``timed_out``) and
Runs cancelled while still queued (only a reconciler can end those). Mid-load the test
kills Worker C (restarted at once on the same inbox), then control replica 0 and ingress
replica 1; `up`'s supervisor must start both again on the same addresses while the other
replicas keep serving.

Afterwards, from the database: every Run is terminal exactly once with the outcome its
executor really had (an Attempt of the killed Worker too records its executor's own exit
code), at most one Attempt was live at any moment (between an ``attempt.claimed`` and
that Attempt's terminal Event no other Attempt of the Run was claimed), every event
sequence is 1..n, no ``run.cancel_requested`` or reconciler Event is repeated, and no
command ran twice (the executors' marks). Each control replica's reconciler did a share
of the work, read from its own log's ``reconciled:`` lines.

That share is made certain, not left to the race: in two rounds, one control replica is
paused (SIGSTOP) while queued Runs are cancelled through the other replica's ingress, so
the running replica's reconciler must converge them (SKIP LOCKED hands it every row).
Whatever the replicas share by themselves during the load is reported as well.

Size: ``QINGLONG_SOAK_RUNS`` Runs (default 90, well under a minute; ``make soak`` uses 300).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final, TypeVar

import grpc
import psycopg
import pytest
from psycopg.rows import dict_row
from qinglong.control.v1 import run_service_pb2, task_service_pb2
from qinglong.rpc.v1 import execution_pb2
from qinglong_cli.pki import ensure_dev_pki, ensure_worker_identity, worker_uri
from qinglong_control.db.identities import enroll_worker
from qinglong_control.settings import ENV_RECONCILE_INTERVAL_SECONDS
from qinglong_worker.reconcile import RESTARTED_WHILE_LAUNCHING

from tests.support.devstack_process import DevStack, dev_stack
from tests.support.executor_marks import Marks, kill_leftovers, marked_command
from tests.support.fault_rig import UNSTARTABLE
from tests.support.fault_tally import (
    Expected,
    Tally,
    assert_verdict,
    compute_tally,
    terminal_states,
    wait_until_terminal,
)
from tests.support.operator_client import CALL_TIMEOUT_SECONDS, OperatorClient
from tests.support.polling import wait_until
from tests.support.worker_process import WorkerProcess

#: How many Runs the load has (`make soak` sets 300).
ENV_SOAK_RUNS: Final = "QINGLONG_SOAK_RUNS"
DEFAULT_RUNS: Final = 90
CONCURRENCY: Final = 6
TIMEOUT_MS: Final = 1500
#: Far longer than TIMEOUT_MS: only the deadline can end these executors.
TIMEOUT_EXECUTOR_SECONDS: Final = 60
RESTART_SECONDS: Final = 30.0
RETRY_SECONDS: Final = 30.0
CONVERGE_SECONDS: Final = 30.0
STALL_SECONDS: Final = 120.0
_RECONCILED: Final = re.compile(
    r"reconciled: (\d+) leases expired, (\d+) runs converged, (\d+) blocked, "
    r"(\d+) retries scheduled, (\d+) exhausted, (\d+) requeued"
)
_LIVE_ATTEMPT_EVENTS: Final = frozenset({"attempt.claimed", "attempt.starting", "attempt.running"})

_T = TypeVar("_T")


def soak_runs() -> int:
    return max(30, int(os.environ.get(ENV_SOAK_RUNS, DEFAULT_RUNS)))


@dataclasses.dataclass(frozen=True)
class Mix:
    """How `runs` Runs are split between the kinds of the load."""

    runs: int

    @property
    def converged_per_replica(self) -> int:
        return max(2, self.runs // 30)

    @property
    def cancelled(self) -> int:
        return max(3, self.runs // 10)

    @property
    def timed_out(self) -> int:
        return max(3, self.runs // 10)

    @property
    def unstartable(self) -> int:
        return max(2, self.runs // 20)

    @property
    def completing(self) -> int:
        """Successes and failures: the rest."""
        return (
            self.runs
            - 2 * self.converged_per_replica
            - self.cancelled
            - self.timed_out
            - self.unstartable
        )


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


def _trigger(
    operator: OperatorClient, command: list[str], *, name: str, timeout_ms: int | None = None
) -> str:
    """Like `OperatorClient.trigger`, with an optional execution timeout (R-TO-1)."""
    task = operator.tasks.CreateTask(
        task_service_pb2.CreateTaskRequest(
            project_id=operator.project_id, request_id=uuid.uuid4().hex, display_name=name
        ),
        metadata=operator.metadata,
        timeout=CALL_TIMEOUT_SECONDS,
    )
    plan = execution_pb2.ExecutionPlan(
        executor_type=execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER, command=command
    )
    if timeout_ms is not None:
        plan.timeout_ms = timeout_ms
    operator.tasks.CreateTaskRevision(
        task_service_pb2.CreateTaskRevisionRequest(
            project_id=operator.project_id,
            task_id=task.task.task_id,
            request_id=uuid.uuid4().hex,
            plan=plan,
        ),
        metadata=operator.metadata,
        timeout=CALL_TIMEOUT_SECONDS,
    )
    run = operator.runs.TriggerRun(
        run_service_pb2.TriggerRunRequest(
            project_id=operator.project_id,
            task_id=task.task.task_id,
            request_id=uuid.uuid4().hex,
        ),
        metadata=operator.metadata,
        timeout=CALL_TIMEOUT_SECONDS,
    )
    return str(run.run.run_id)


def _extra_worker(stack: DevStack, worker_id: str) -> tuple[str, ...]:
    """Another Worker identity from the stack's own dev CA, enrolled like `up` enrolls
    its Worker; returns the `qinglong-worker` flags that select it."""
    pki = ensure_dev_pki(stack.data_dir / "pki")
    tls = ensure_worker_identity(pki, worker_id)
    with psycopg.connect(stack.migration_url, autocommit=True) as conn:
        enroll_worker(conn, worker_id, worker_uri(pki.trust_domain, worker_id))
    return ("--worker-id", worker_id, "--tls-cert", str(tls.cert), "--tls-key", str(tls.key))


_SHORT_RUN_ID: Final = re.compile(r"\b[0-9a-f]{8}\b")


def _worker_lines_of_wrong_runs(tally: Tally, workers: list[WorkerProcess]) -> list[str]:
    """Every Worker's log lines about each Run the tally found wrong (lost, duplicated,
    wrong outcome): a rare interleaving is explained by them, not by the logs' tails."""
    named = tally.runs_lost + tally.duplicate_attempts + tally.wrong_outcomes
    short_ids = sorted({match for line in named for match in _SHORT_RUN_ID.findall(line)})
    found = []
    for index, worker in enumerate(workers):
        for short_id in short_ids:
            lines = [line for line in worker.log_text().splitlines() if f"run {short_id}" in line]
            if lines:
                found.append(f"worker {index} on run {short_id}:\n" + "\n".join(lines))
    return found


def _reconciler_work(log: Path) -> Counter[str]:
    """What one replica's reconciler reports having done, summed over its log."""
    names = ("expired", "converged", "blocked", "scheduled", "exhausted", "requeued")
    work: Counter[str] = Counter()
    for match in _RECONCILED.finditer(log.read_text(errors="replace") if log.exists() else ""):
        work["cycles"] += 1
        for name, value in zip(names, match.groups(), strict=True):
            work[name] += int(value)
    return work


def _through(stack: DevStack, ingress_entry: dict[str, Any]) -> OperatorClient:
    """An operator client bound to one ingress replica (the stack's own credentials)."""
    return OperatorClient(
        dataclasses.replace(stack, document={**stack.document, "ingress": ingress_entry})
    )


def _converge_on_one_replica(
    stack: DevStack, working: int, count: int, expected: list[Expected]
) -> str | None:
    """Pause the other control replica, cancel `count` queued Runs through ingress replica
    `working`: only control replica `working`'s reconciler can end them. A problem, or None."""
    paused = stack.replicas("control")[1 - working]["pid"]
    operator = _through(stack, stack.replicas("ingress")[working])
    run_ids = []
    os.kill(paused, signal.SIGSTOP)
    try:
        for index in range(count):
            run_id = _trigger(operator, ["true"], name=f"converge-{working}-{index}")
            operator.cancel(run_id)
            run_ids.append(run_id)
            expected.append(Expected(run_id, "cancelled", label=f"converge-{working}-{index}"))
        if not wait_until_terminal(stack.migration_url, run_ids, CONVERGE_SECONDS):
            return f"control replica {working} did not converge queued cancelled Runs alone"
        return None
    finally:
        os.kill(paused, signal.SIGCONT)
        operator.close()


def _event_audit(migration_url: str, run_ids: list[str]) -> tuple[list[str], list[str]]:
    """From the Events alone: (overlapping live Attempts, repeated reconciler Events)."""
    with psycopg.connect(migration_url, connect_timeout=5, row_factory=dict_row) as conn:
        rows = conn.execute(
            "SELECT run_id::text AS run_id, sequence, event_type, attempt_id::text AS attempt_id,"
            " actor_kind FROM qinglong.run_events WHERE run_id = ANY(%s::uuid[])"
            " ORDER BY run_id, sequence",
            (run_ids,),
        ).fetchall()
    events: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        events[row["run_id"]].append(row)
    overlaps: list[str] = []
    repeats: list[str] = []
    for run_id, found in events.items():
        live: str | None = None
        for event in found:
            kind, attempt = event["event_type"], event["attempt_id"]
            if not kind.startswith("attempt.") or attempt is None:
                continue
            if kind == "attempt.claimed":
                if live is not None and live != attempt:
                    overlaps.append(
                        f"Run {run_id[:8]}: Attempt {attempt[:8]} claimed at sequence "
                        f"{event['sequence']} while Attempt {live[:8]} was live"
                    )
                live = attempt
            elif kind not in _LIVE_ATTEMPT_EVENTS and attempt == live:
                live = None
        by_reconciler = Counter(
            (event["event_type"], event["attempt_id"])
            for event in found
            if event["actor_kind"] == "reconciler"
        )
        repeats += [
            f"Run {run_id[:8]}: reconciler Event {kind} {count} times"
            for (kind, _), count in by_reconciler.items()
            if count > 1
        ]
    return overlaps, repeats


#: The restarted Worker's line for a `launching` record whose launch it claimed first.
_NEVER_STARTED_LINE: Final = re.compile(
    r"run ([0-9a-f-]{36}): quarantined start_failed \(EXECUTOR_START_FAILED: "
    + re.escape(RESTARTED_WHILE_LAUNCHING)
)


def _caught_before_the_launch_claim(log: str, started: dict[str, int]) -> set[str]:
    """Runs a kill -9 caught after the Worker persisted `launching` and before the
    supervisor claimed the launch (it may not even have been forked). The restarted
    Worker claims the launch "never started", which fences any late supervisor, and
    reports a start failure: docs/worker-operations.md, "Executors, supervisors, and what
    survives a crash". Such a Run must have run nothing: one whose executor left a mark is
    not excused, and keeps the outcome its executor would have had."""
    return {run_id for run_id in _NEVER_STARTED_LINE.findall(log) if started.get(run_id, 0) == 0}


def _explain(migration_url: str, run_ids: list[str]) -> list[str]:
    """For a Run that ended otherwise than expected: its error code and its Events."""
    if not run_ids:
        return []
    with psycopg.connect(migration_url, connect_timeout=5) as conn:
        rows = conn.execute(
            "SELECT r.run_id::text, r.error_code, string_agg(e.event_type || '/' ||"
            " e.actor_kind || coalesce(':' || (e.payload->>'error_code'), ''), ' '"
            " ORDER BY e.sequence) FROM qinglong.runs r JOIN qinglong.run_events e"
            " USING (run_id) WHERE r.run_id = ANY(%s::uuid[]) GROUP BY 1, 2",
            (run_ids,),
        ).fetchall()
    return [f"Run {run_id[:8]} ({error}): {events}" for run_id, error, events in rows]


def test_two_replicas_three_workers_survive_kills_mid_load(
    stack: DevStack, scratch: Path, report_tally: Callable[[Tally], None]
) -> None:
    mix = Mix(soak_runs())
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
            extra_flags=_extra_worker(stack, "replica-worker-b"),
        ),
        WorkerProcess(
            stack,
            scratch / "worker-c" / "inbox.db",
            address=ingress[0]["address"],
            max_concurrency=CONCURRENCY,
            extra_flags=_extra_worker(stack, "replica-worker-c"),
        ),
    ]
    victim_worker = workers[2]
    operator = OperatorClient(stack)
    expected: list[Expected] = []
    problems: list[str] = []
    restart_seconds = float("nan")
    load_seconds = float("nan")
    pending_cancel: set[str] = set()
    try:
        # Each replica's reconciler alone converges queued cancelled Runs (no Worker yet).
        for working in (0, 1):
            problem = _converge_on_one_replica(stack, working, mix.converged_per_replica, expected)
            if problem:
                problems.append(problem)
        work_before_load = [_reconciler_work(Path(entry["log"])) for entry in controls]

        # The load, interleaved so that every kind runs throughout.
        kinds = (
            ["complete"] * mix.completing
            + ["cancel"] * mix.cancelled
            + ["timeout"] * mix.timed_out
            + ["unstartable"] * mix.unstartable
        )
        order = sorted(range(len(kinds)), key=lambda i: (i * 7919) % len(kinds))
        marked = 0
        for position, index in enumerate(order):
            kind = kinds[index]
            name = f"{kind}-{position}"
            if kind == "complete":
                exit_code = 0 if position % 3 else 3
                command = marked_command(
                    marks, seconds=0.3 + (position % 4) * 0.4, exit_code=exit_code
                )
                run_id = _trigger(operator, command, name=name)
                outcome = "succeeded" if exit_code == 0 else "failed"
                expected.append(Expected(run_id, outcome, exit_code=exit_code, label=name))
                marked += 1
            elif kind == "cancel":
                command = marked_command(marks, seconds=120, exit_code=0)
                run_id = _trigger(operator, command, name=name)
                pending_cancel.add(run_id)
                expected.append(Expected(run_id, "cancelled", label=name))
                marked += 1
            elif kind == "timeout":
                command = marked_command(marks, seconds=TIMEOUT_EXECUTOR_SECONDS, exit_code=0)
                run_id = _trigger(operator, command, name=name, timeout_ms=TIMEOUT_MS)
                expected.append(
                    Expected(run_id, "timed_out", error_code="EXECUTION_TIMED_OUT", label=name)
                )
                marked += 1
            else:
                run_id = _trigger(operator, list(UNSTARTABLE), name=name)
                expected.append(
                    Expected(run_id, "failed", error_code="EXECUTOR_START_FAILED", label=name)
                )
        run_ids = [e.run_id for e in expected]
        load_started = time.monotonic()
        for worker in workers:
            worker.start()

        kill_worker_at = max(6, marked // 4)
        kill_services_at = max(kill_worker_at + 4, marked // 2)
        worker_killed = services_killed = False
        victims: dict[str, int] = {}
        killed_at = 0.0
        progress_at, last_started = time.monotonic(), -1
        while True:
            seen = Marks.read(marks)
            started = sum(seen.counts().values())
            if started != last_started:
                progress_at, last_started = time.monotonic(), started
            # User cancels, once the executor runs (retried across a replica restart).
            for run_id in sorted(pending_cancel):
                if seen.of(run_id):
                    _retrying(lambda run_id=run_id: operator.cancel(run_id))
                    pending_cancel.discard(run_id)
            # Under load the kill lands at a random step of one of Worker C's six Runs, a
            # spawn included (tests/faults kills at each step deterministically).
            if not worker_killed and started >= kill_worker_at:
                victim_worker.kill9()
                if victim_worker.wait() is None:
                    problems.append("Worker C survived kill -9")
                victim_worker.start()  # the same inbox, the same identity
                worker_killed = True
            if worker_killed and not services_killed and started >= kill_services_at:
                victims = {"control": controls[0]["pid"], "ingress": ingress[1]["pid"]}
                for pid in victims.values():
                    os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
                services_killed = True
            try:
                states = terminal_states(stack.migration_url, run_ids)
            except psycopg.OperationalError:
                states = {}
            if services_killed and all(
                states.get(run_id) in ("succeeded", "failed", "cancelled", "timed_out")
                for run_id in run_ids
            ):
                break
            if time.monotonic() - progress_at > STALL_SECONDS:
                problems.append(
                    f"no executor started for {STALL_SECONDS:.0f} s ({started} started, "
                    f"worker killed: {worker_killed}, replicas killed: {services_killed})"
                )
                break
            time.sleep(0.2)
        load_seconds = time.monotonic() - load_started

        def restarted() -> bool:
            now = {"control": stack.replicas("control")[0], "ingress": stack.replicas("ingress")[1]}
            return all(
                now[name]["restarts"] >= 1 and now[name]["pid"] != pid
                for name, pid in victims.items()
            )

        if services_killed:
            if not wait_until(restarted, RESTART_SECONDS):
                problems.append(f"the supervisor did not restart {victims} in {RESTART_SECONDS} s")
            restart_seconds = time.monotonic() - killed_at
            after = stack.reread()["replicas"]
            for name, index in (("control", 0), ("ingress", 1)):
                before_address = (controls if name == "control" else ingress)[index]["address"]
                if after[name][index]["address"] != before_address:
                    problems.append(f"{name} replica {index} came back on another address")
        if not wait_until_terminal(stack.migration_url, run_ids, CONVERGE_SECONDS):
            problems.append("not every Run was terminal at the end")
        if not stack.running():
            problems.append("qinglong up exited after a replica was killed")
    finally:
        statuses = [worker.stop() for worker in workers]
        operator.close()
        kill_leftovers(marks)
    problems += [
        f"Worker {i} exited {status} on SIGINT" for i, status in enumerate(statuses) if status
    ]
    caught = _caught_before_the_launch_claim(victim_worker.log_text(), Marks.read(marks).counts())
    expected = [
        Expected(e.run_id, "failed", error_code="EXECUTOR_START_FAILED", label=e.label)
        if e.run_id in caught
        else e
        for e in expected
    ]
    pending_cancel -= caught
    if pending_cancel:
        problems.append(f"{len(pending_cancel)} Runs to cancel never started an executor")

    run_ids = [e.run_id for e in expected]
    tally = compute_tally(
        f"2 control + 2 ingress + 3 Workers, {len(expected)} Runs, kill -9 a Worker, "
        "a control and an ingress",
        stack.migration_url,
        expected,
        executions=Marks.read(marks).counts(),
        extra_calls=3 * len(expected),  # CreateTask, CreateTaskRevision, TriggerRun
        extra_faults=3 + 2,  # three kills, two pauses
    )
    overlaps, repeats = _event_audit(stack.migration_url, run_ids)
    tally.duplicate_attempts += overlaps
    tally.duplicate_events += repeats
    final = terminal_states(stack.migration_url, run_ids)
    outcomes = Counter(final.values())
    # Every Run the tally found wrong (state, error code or exit code), with its Events.
    flagged = [e.run_id for e in expected if any(e.name in w for w in tally.wrong_outcomes)]
    tally.notes += _explain(stack.migration_url, flagged)
    tally.notes.append(
        "outcomes: " + ", ".join(f"{state} {count}" for state, count in sorted(outcomes.items()))
    )
    if caught:
        tally.notes.append(
            f"{len(caught)} of Worker C's Runs caught by the kill before their supervisor"
            " claimed the launch: declared never started, none ran, reported start failures"
        )
    tally.notes.append(
        f"load drained in {load_seconds:.1f} s; the supervisor restarted the killed control "
        f"and ingress replicas within {restart_seconds:.1f} s; Worker C incarnations "
        f"{victim_worker.incarnations}, executors it adopted from their launch claims (after "
        f"the kill, or a supervisor slow to answer): "
        f"{victim_worker.log_text().count(': adopted pid:')}"
    )
    for index, entry in enumerate(stack.replicas("control")):
        work = _reconciler_work(Path(entry["log"]))
        during_load = (
            work["converged"]
            + work["expired"]
            - (work_before_load[index]["converged"] + work_before_load[index]["expired"])
        )
        tally.notes.append(
            f"reconciler {Path(entry['log']).name}: {work['cycles']} productive cycles, "
            f"{work['converged']} converged, {work['expired']} leases expired, "
            f"{work['requeued']} requeued ({during_load} converged/expired during the load)"
        )
        if work["converged"] < mix.converged_per_replica:
            problems.append(
                f"control replica {index}'s log reports {work['converged']} converged Runs, "
                f"at least {mix.converged_per_replica} were its alone"
            )
    report_tally(tally)
    if problems or not tally.clean:
        problems += _worker_lines_of_wrong_runs(tally, workers)
        problems += [f"worker {i} log tail:\n{w.log_tail()}" for i, w in enumerate(workers)]
    assert_verdict(tally, problems)
