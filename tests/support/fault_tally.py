"""The fault tally: what a fault test did, and what the control plane ended up recording.

It is computed from the database itself (runs, attempts, run_events, read as the schema
owner), compared with what the test expected and with what really ran on the machine
(the executors' marks). The three counts that must be zero:

* **Runs lost** -- a Run not terminal at the end (``lost`` is not terminal either), a Run
  whose row is missing, or a Run whose events do not add up to its ``event_sequence``;
* **duplicates** -- more Attempts that reached ``starting`` than the Run allows, two
  Attempts alive at once, a command that really started more often than allowed, an
  event sequence that is not exactly 1..n, or an event repeated where it must be unique;
* **wrong outcomes** -- a terminal state, error code or exit code that is not what the
  executor really did.

Every finding is kept as a sentence, so a failing assertion says exactly what went wrong.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row

from tests.support.lossy_proxy import FaultSchedule

TERMINAL_RUN_STATES: Final = frozenset({"succeeded", "failed", "cancelled", "timed_out"})
TERMINAL_RUN_EVENTS: Final = frozenset(f"run.{state}" for state in TERMINAL_RUN_STATES)
LIVE_ATTEMPT_STATES: Final = frozenset({"claimed", "starting", "running"})
#: Events a Run carries at most once (with no retry policy, one Attempt may start).
ONCE_PER_RUN: Final = frozenset({"run.cancel_requested", "run.running"})


@dataclass(frozen=True)
class Expected:
    """What a Run must end as, given what its executor does when left alone."""

    run_id: str
    state: str
    exit_code: int | None = None
    """The exit status the final Attempt must record; None: not checked (never ran)."""
    error_code: str | None = None
    """The Run's error code, when the SPEC fixes one; None: not checked."""
    max_started: int = 1
    """Attempts that may reach ``starting`` (1: the plan has no retry policy)."""
    label: str = ""

    @property
    def name(self) -> str:
        return f"{self.label or 'run'} {self.run_id[:8]}"


@dataclass
class Tally:
    scenario: str
    calls: int = 0
    faults: int = 0
    runs: int = 0
    runs_lost: list[str] = field(default_factory=list)
    duplicate_attempts: list[str] = field(default_factory=list)
    duplicate_events: list[str] = field(default_factory=list)
    wrong_outcomes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Context that is not a failure by itself (calls per method, latencies, ...)."""

    @property
    def clean(self) -> bool:
        return not (
            self.runs_lost
            or self.duplicate_attempts
            or self.duplicate_events
            or self.wrong_outcomes
        )

    def row(self) -> str:
        return (
            f"{self.scenario}: calls {self.calls}, faults {self.faults}, runs {self.runs}, "
            f"lost {len(self.runs_lost)}, duplicate attempts {len(self.duplicate_attempts)}, "
            f"duplicate events {len(self.duplicate_events)}, "
            f"wrong outcomes {len(self.wrong_outcomes)}"
        )

    def render(self) -> str:
        lines = [f"TALLY {self.row()}"]
        for title, items in (
            ("lost", self.runs_lost),
            ("duplicate attempt", self.duplicate_attempts),
            ("duplicate event", self.duplicate_events),
            ("wrong outcome", self.wrong_outcomes),
            ("note", self.notes),
        ):
            lines += [f"  {title}: {item}" for item in items]
        return "\n".join(lines)


def terminal_states(migration_url: str, run_ids: Iterable[str]) -> dict[str, str]:
    with psycopg.connect(migration_url, connect_timeout=5) as conn:
        rows = conn.execute(
            "SELECT run_id::text, state FROM qinglong.runs WHERE run_id = ANY(%s::uuid[])",
            (list(run_ids),),
        ).fetchall()
    return {str(run_id): str(state) for run_id, state in rows}


def wait_until_terminal(migration_url: str, run_ids: Iterable[str], seconds: float) -> bool:
    """Poll the database until every Run is terminal (True) or `seconds` pass (False)."""
    wanted = list(run_ids)
    deadline = time.monotonic() + seconds
    while True:
        try:
            states = terminal_states(migration_url, wanted)
        except psycopg.OperationalError:
            states = {}
        if len(states) == len(wanted) and set(states.values()) <= TERMINAL_RUN_STATES:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def _rows(
    conn: psycopg.Connection[dict[str, Any]], query: str, run_ids: list[str]
) -> list[dict[str, Any]]:
    return conn.execute(query, (run_ids,)).fetchall()


def compute_tally(
    scenario: str,
    migration_url: str,
    expected: Iterable[Expected],
    *,
    schedule: FaultSchedule | None = None,
    executions: Mapping[str, int] | None = None,
    extra_calls: int = 0,
    extra_faults: int = 0,
) -> Tally:
    """`executions`: how often each Run's command really started (from its marks)."""
    wanted = {item.run_id: item for item in expected}
    run_ids = list(wanted)
    with psycopg.connect(migration_url, connect_timeout=5, row_factory=dict_row) as conn:
        runs = {
            str(row["run_id"]): row
            for row in _rows(
                conn,
                "SELECT run_id, state, error_code, event_sequence, attempt_count"
                " FROM qinglong.runs WHERE run_id = ANY(%s::uuid[])",
                run_ids,
            )
        }
        attempts: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in _rows(
            conn,
            "SELECT run_id, attempt_id, attempt_number, state, claimed_at_ms, starting_at_ms,"
            " finished_at_ms, exit_code, error_code FROM qinglong.attempts"
            " WHERE run_id = ANY(%s::uuid[]) ORDER BY run_id, attempt_number",
            run_ids,
        ):
            attempts[str(row["run_id"])].append(row)
        events: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in _rows(
            conn,
            "SELECT run_id, sequence, event_type, attempt_id FROM qinglong.run_events"
            " WHERE run_id = ANY(%s::uuid[]) ORDER BY run_id, sequence",
            run_ids,
        ):
            events[str(row["run_id"])].append(row)

    tally = Tally(scenario, runs=len(wanted))
    if schedule is not None:
        tally.calls = sum(schedule.calls.values())
        tally.faults = sum(schedule.faults.values())
        tally.notes.append(f"calls/faults per method: {schedule.summary()}")
    tally.calls += extra_calls
    tally.faults += extra_faults
    for run_id, want in wanted.items():
        run = runs.get(run_id)
        if run is None:
            tally.runs_lost.append(f"{want.name}: no such Run in the database")
            continue
        _check_run(tally, want, run, attempts[run_id], events[run_id])
        if executions is not None:
            started = executions.get(run_id, 0)
            if started > want.max_started:
                tally.duplicate_attempts.append(
                    f"{want.name}: its command really started {started} times"
                )
    return tally


def _check_run(
    tally: Tally,
    want: Expected,
    run: Mapping[str, Any],
    attempts: list[dict[str, Any]],
    events: list[dict[str, Any]],
) -> None:
    state = str(run["state"])
    if state not in TERMINAL_RUN_STATES:
        tally.runs_lost.append(f"{want.name}: still {state}, expected {want.state}")
    elif state != want.state:
        tally.wrong_outcomes.append(f"{want.name}: ended {state}, expected {want.state}")
    elif want.error_code is not None and run["error_code"] != want.error_code:
        tally.wrong_outcomes.append(
            f"{want.name}: error code {run['error_code']}, expected {want.error_code}"
        )
    if want.exit_code is not None and state in TERMINAL_RUN_STATES:
        last = attempts[-1] if attempts else None
        recorded = None if last is None else last["exit_code"]
        if recorded != want.exit_code:
            tally.wrong_outcomes.append(
                f"{want.name}: Attempt recorded exit code {recorded}, "
                f"the executor exited {want.exit_code}"
            )

    started = [attempt for attempt in attempts if attempt["starting_at_ms"] is not None]
    if len(started) > want.max_started:
        tally.duplicate_attempts.append(
            f"{want.name}: {len(started)} Attempts reached starting (at most {want.max_started})"
        )
    for earlier, later in itertools.pairwise(attempts):
        ended = earlier["finished_at_ms"]
        if ended is None or ended > later["claimed_at_ms"]:
            tally.duplicate_attempts.append(
                f"{want.name}: Attempts {earlier['attempt_number']} and "
                f"{later['attempt_number']} were alive at the same time"
            )
    live = [attempt for attempt in attempts if attempt["state"] in LIVE_ATTEMPT_STATES]
    if len(live) > 1:
        tally.duplicate_attempts.append(f"{want.name}: {len(live)} live Attempts")

    _check_events(tally, want, run, events)


def _check_events(
    tally: Tally, want: Expected, run: Mapping[str, Any], events: list[dict[str, Any]]
) -> None:
    sequences = [int(event["sequence"]) for event in events]
    if sequences != list(range(1, len(sequences) + 1)):
        tally.duplicate_events.append(f"{want.name}: event sequence is {sequences}, not 1..n")
    if len(sequences) != int(run["event_sequence"]):
        tally.runs_lost.append(
            f"{want.name}: {len(sequences)} events, but the Run counts {run['event_sequence']}"
        )
    per_attempt = Counter(
        (str(event["attempt_id"]), str(event["event_type"]))
        for event in events
        if event["attempt_id"] is not None
    )
    for (attempt_id, event_type), count in sorted(per_attempt.items()):
        if count > 1:
            tally.duplicate_events.append(
                f"{want.name}: {event_type} {count} times for Attempt {attempt_id[:8]}"
            )
    per_run = Counter(str(event["event_type"]) for event in events)
    terminal = sum(per_run[event_type] for event_type in TERMINAL_RUN_EVENTS)
    if terminal > 1:
        tally.duplicate_events.append(f"{want.name}: {terminal} terminal Run events")
    for event_type in sorted(ONCE_PER_RUN):
        if per_run[event_type] > 1 and want.max_started == 1:
            tally.duplicate_events.append(f"{want.name}: {event_type} {per_run[event_type]} times")
    if str(run["state"]) in TERMINAL_RUN_STATES:
        if terminal == 0:
            tally.runs_lost.append(f"{want.name}: terminal, but no terminal Run event")
        elif events and events[-1]["event_type"] != f"run.{run['state']}":
            tally.wrong_outcomes.append(
                f"{want.name}: last event {events[-1]['event_type']}, state {run['state']}"
            )


def assert_verdict(tally: Tally, problems: list[str]) -> None:
    """Lost, duplicates and wrong outcomes are all zero, and the scenario's own checks
    found no problem. The message is the whole tally plus every problem."""
    message = tally.render() + "".join(f"\n  problem: {problem}" for problem in problems)
    failed = bool(problems) or not tally.clean
    assert not failed, message
