"""Scale check (issue 11, part 5): do the hot paths stay flat as the history grows?

Three figures, each a ratio measured in one run (never a timed assertion):

1. AcknowledgeRunning at 1,000,000 Runs vs 1,000 Runs (target <= 1.1x). Two databases in
   one embedded PostgreSQL: `small` holds 1,000 Runs (980 terminal, 10 waiting, 10
   running), `large` is bulk-loaded to 1,000,000, 99 % of them terminal (succeeded /
   failed / cancelled, with their Offers, Attempts, Leases and Events as the commands
   would have written them), the other 1 % half waiting (queued, or in retry_wait until
   later), half running with a live lease. The command is the repository's
   `acknowledge_running` on a runtime-role autocommit connection, as bench_ack.py runs
   it; the work is prepared outside the timed region the way a Worker meets it:
   placement offers the oldest queued Runs (on `large`, the backlog the load left), the
   bench claims them and acknowledges `starting`, and triggers as many new Runs of the
   same bulk task, so both databases acknowledge the same kind of Run and keep their
   backlog. The databases are measured interleaved, in a shuffled order per iteration,
   so they share the machine's noise.
2. The reconciler's cycle when nothing is due, with 10 pending Runs vs 100,000 (target
   <= 1.2x): `Reconciler.cycle()` (lease expiry, convergence pages, retry pages) on
   `small` (10 waiting Runs, 10 live leases) and on `pending` (the same history with
   100,000 waiting Runs and 100,000 running Attempts whose leases are live; nothing
   expires or becomes due during the run). Each step is also timed alone, and `large` is
   cycled as a third column. Every cycle's report must say it found no work; the table
   says how many did.
3. The Worker daemon's RSS per supervised Attempt over its idle baseline (target <= 8 MiB
   per 1,000). A Worker supervises at most 64 Attempts at once (the contract's bound on
   `max_concurrent_attempts`), so 1,000 at once cannot exist in one daemon, and each
   Attempt runs under a supervisor process of its own (`python -I supervisor.py`, about
   6 MiB PSS), so 1,000 real ones would need some 6 GiB beside the daemon. Measured
   instead on the real dev stack (`qinglong up`) with real `qinglong-worker run`
   processes, RSS sampled over a few seconds once settled: daemon 1, idle after a
   warm-up of 16 Attempts (first-use allocations are not charged to the figure), then
   with 16, 32, 48 and 64 Attempts running `sleep` at once -- the least-squares slope,
   x 1,000, is the figure, an extrapolation the table says it is; daemon 2, a fresh
   process (Python keeps memory it once used, so each figure needs its own baseline),
   idle after its warm-up and after 1,000 more Attempts ran to completion -- what 1,000
   supervised Attempts leave behind. The supervisors' mean RSS / PSS / USS is printed
   beside it: that, not the daemon, is what a running Attempt costs the host.

A default run takes about seven minutes on two cores, four of them the bulk load.

    .venv/bin/python bench/bench_scale.py [--runs 1000000] [--pending 100000]
        [--iterations 300] [--cycles 300] [--worker-attempts 1000] [--parts ack,cycle,worker]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import psutil
import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool
from qinglong.control.v1 import (
    run_service_pb2,
    run_service_pb2_grpc,
    task_service_pb2,
    task_service_pb2_grpc,
)
from qinglong.rpc.v1 import execution_pb2
from qinglong_cli.embedded_postgres import EmbeddedPostgres, start_embedded_postgres
from qinglong_control.db import placement, runs
from qinglong_control.db.bootstrap import bootstrap_database
from qinglong_control.db.identities import enroll_worker, ensure_project
from qinglong_control.db.pool import RECONCILER_SETTINGS
from qinglong_control.db.roles import RoleUrls
from qinglong_control.db.sql import SQL
from qinglong_control.db.start_facts import acknowledge_running, acknowledge_starting
from qinglong_control.domain.fence import Fence
from qinglong_control.reconciler import CycleReport, Reconciler, ReconcilerLimits
from qinglong_protocol.bounds import MAX_CONCURRENT_ATTEMPTS_MAX
from qinglong_protocol.storage import StorageBounds
from qinglong_protocol.tls import mutual_tls_channel_credentials
from qinglong_worker.settings import DEFAULT_LEASE_CONTROL_SECONDS, DEFAULT_TICK_SECONDS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import bench_ack, percentiles
from tests.support.devstack_process import DevStack, dev_stack
from tests.support.worker_process import WorkerProcess

_T = TypeVar("_T")

# --- populations and the bulk load -----------------------------------------------------------

BULK_PROJECT = "bulk"
#: Closed Sessions each ran this many Attempts; an online one holds at most this many
#: running Attempts (a Session's max_concurrency is at most 1024).
ATTEMPTS_PER_SESSION = 1000
MIN_BULK_WORKERS = 4
BULK_TASKS = 16
#: Live leases and retry_at lie this far ahead, so nothing the load wrote becomes due
#: while the bench runs.
NOT_DUE_FOR_MS = 6 * 3_600_000
LOAD_BATCH = 100_000


@dataclass(frozen=True)
class Population:
    """What one database holds: `terminal` Runs of the past, then `waiting` Runs (85 %
    queued, 15 % in retry_wait after a failed Attempt, retry not yet due), then `running`
    Runs whose Attempts hold live leases."""

    name: str
    terminal: int
    waiting: int
    running: int

    @property
    def runs(self) -> int:
        return self.terminal + self.waiting + self.running

    @property
    def workers(self) -> int:
        return max(MIN_BULK_WORKERS, math.ceil(self.running / ATTEMPTS_PER_SESSION))

    @property
    def closed_sessions(self) -> int:
        return math.ceil(self.runs / ATTEMPTS_PER_SESSION)

    @property
    def live_generation(self) -> int:
        """Above every closed Session's generation (closed Session s is generation
        s // workers + 1 of Worker s % workers)."""
        return self.closed_sessions // self.workers + 2

    def describe(self) -> str:
        return (
            f"{self.runs:,} Runs: {self.terminal:,} terminal, {self.waiting:,} waiting,"
            f" {self.running:,} running with live leases"
        )


def population(name: str, runs: int, pending: int, running: int) -> Population:
    return Population(name, runs - pending - running, pending, running)


_BULK_TASKS = """
INSERT INTO qinglong.tasks (task_id, project_id, display_name, create_request_id, created_by)
SELECT md5('task' || t)::uuid, %(project)s, 'bulk task ' || t, 'bulk-task-' || t, 'bulk'
  FROM generate_series(0, %(tasks)s - 1) AS t
"""

# Retries on failure (retry_wait Runs need a policy that retries), no deadline to pass.
_BULK_REVISIONS = """
INSERT INTO qinglong.task_revisions
       (revision_id, project_id, task_id, revision_number, executor_type, command, timeout_ms,
        create_request_id, created_by, retry_max_attempts, retry_initial_backoff_ms,
        retry_max_backoff_ms, retry_on)
SELECT md5('revision' || t)::uuid, %(project)s, md5('task' || t)::uuid, 1, 'remote_worker',
       '["true"]', NULL, 'bulk-revision-' || t, 'bulk', 3, 1000, 60000, '{failed}'
  FROM generate_series(0, %(tasks)s - 1) AS t
"""

_CLOSED_SESSIONS = """
INSERT INTO qinglong.worker_sessions
       (session_id, worker_id, generation, status, executor_types, max_concurrency,
        open_request_id, opened_at_ms, renewed_at_ms, expires_at_ms, closed_at_ms)
SELECT md5('session' || s)::uuid, 'bulk-' || lpad((s %% %(workers)s)::text, 4, '0'),
       s / %(workers)s + 1, 'closed', ARRAY['remote_worker'], 1024, 'bulk-session-' || s,
       %(since)s, %(since)s, %(since)s + 30000, %(since)s + 30000
  FROM generate_series(0, %(sessions)s - 1) AS s
"""

_LIVE_SESSIONS = """
INSERT INTO qinglong.worker_sessions
       (session_id, worker_id, generation, status, executor_types, max_concurrency,
        open_request_id, opened_at_ms, renewed_at_ms, expires_at_ms)
SELECT md5('live-session' || w)::uuid, 'bulk-' || lpad(w::text, 4, '0'), %(generation)s,
       'online', ARRAY['remote_worker'], 1024, 'bulk-live-' || w, %(now)s, %(now)s,
       %(now)s + %(not_due)s
  FROM generate_series(0, %(workers)s - 1) AS w
"""

# One row per Run of a batch: its kind and every id and instant the tables below need,
# computed once. Terminal Runs come first, one a second up to an hour ago (1,000,000 of
# them span eleven days); waiting and running ones follow, 10 ms apart, up to now.
_PLAN = """
CREATE TEMP TABLE IF NOT EXISTS bulk_plan (
    n bigint, kind text, run_id uuid, task_id uuid, revision_id uuid, attempt_id uuid,
    offer_id uuid, session_id uuid, worker_id text, generation bigint, digest text,
    created bigint, events integer
) ON COMMIT DELETE ROWS
"""

_FILL_PLAN = """
INSERT INTO bulk_plan
SELECT n, kind, md5('run' || n)::uuid, md5('task' || n %% %(tasks)s)::uuid,
       md5('revision' || n %% %(tasks)s)::uuid,
       CASE WHEN kind IN ('queued', 'cancelled') THEN NULL ELSE md5('attempt' || n)::uuid END,
       md5('offer' || n)::uuid,
       CASE WHEN kind = 'running' THEN md5('live-session' || (n - %(first_running)s)
                                            %% %(workers)s)::uuid
            ELSE md5('session' || n / %(per_session)s)::uuid END,
       'bulk-' || lpad((CASE WHEN kind = 'running' THEN (n - %(first_running)s) %% %(workers)s
                             ELSE n / %(per_session)s %% %(workers)s END)::text, 4, '0'),
       CASE WHEN kind = 'running' THEN %(live_generation)s
            ELSE n / %(per_session)s / %(workers)s + 1 END,
       md5('lease' || n) || md5('token' || n),
       CASE WHEN n < %(terminal)s THEN %(now)s - 3600000 - (%(terminal)s - n) * 1000
            ELSE %(now)s - (%(runs)s - n) * 10 END,
       CASE kind WHEN 'queued' THEN 1 WHEN 'cancelled' THEN 3 WHEN 'running' THEN 6 ELSE 8 END
  FROM (SELECT n, CASE
            WHEN n < %(terminal)s THEN CASE WHEN n * 37 %% 100 < 90 THEN 'succeeded'
                                             WHEN n * 37 %% 100 < 97 THEN 'failed'
                                             ELSE 'cancelled' END
            WHEN n < %(first_running)s THEN CASE WHEN (n - %(terminal)s) * 37 %% 100 < 85
                                                  THEN 'queued' ELSE 'retry_wait' END
            ELSE 'running' END AS kind
          FROM generate_series(%(low)s, %(high)s - 1) AS n) AS numbered
"""

# Terminal Runs finished 30.2 s after creation (cancelled ones 0.6 s: cancelled while
# queued); the retry_wait ones failed after 1.2 s and wait until later.
_RUNS = """
INSERT INTO qinglong.runs
       (run_id, project_id, task_id, revision_id, state, executor_type, version,
        event_sequence, attempt_count, trigger_request_id, triggered_by,
        cancel_requested_at_ms, cancel_reason, cancel_requested_by, created_at_ms,
        updated_at_ms, started_at_ms, finished_at_ms, error_code, retry_at_ms)
SELECT run_id, %(project)s, task_id, revision_id, kind, 'remote_worker', events, events,
       CASE WHEN attempt_id IS NULL THEN 0 ELSE 1 END, 'bulk-' || n, 'bulk-operator',
       CASE WHEN kind = 'cancelled' THEN created + 500 END,
       CASE WHEN kind = 'cancelled' THEN 'user' END,
       CASE WHEN kind = 'cancelled' THEN 'bulk-operator' END,
       created,
       CASE kind WHEN 'queued' THEN created WHEN 'cancelled' THEN created + 600
                 WHEN 'running' THEN created + 200 WHEN 'retry_wait' THEN created + 1200
                 ELSE created + 30200 END,
       CASE WHEN attempt_id IS NOT NULL THEN created + 200 END,
       CASE kind WHEN 'cancelled' THEN created + 600
                 WHEN 'succeeded' THEN created + 30200 WHEN 'failed' THEN created + 30200 END,
       CASE kind WHEN 'failed' THEN 'EXECUTION_FAILED'
                 WHEN 'cancelled' THEN 'EXECUTION_CANCELLED' END,
       CASE WHEN kind = 'retry_wait' THEN %(now)s + %(not_due)s END
  FROM bulk_plan
"""

_OFFERS = """
INSERT INTO qinglong.offers
       (offer_id, run_id, session_id, worker_id, worker_generation, state, created_at_ms,
        expires_at_ms, claimed_at_ms)
SELECT offer_id, run_id, session_id, worker_id, generation, 'claimed', created + 50,
       created + 15050, created + 100
  FROM bulk_plan WHERE attempt_id IS NOT NULL
"""

_ATTEMPTS = """
INSERT INTO qinglong.attempts
       (attempt_id, run_id, attempt_number, state, executor_type, worker_id, session_id,
        worker_generation, offer_id, lease_generation, lease_version, lease_token_digest,
        claimed_at_ms, starting_at_ms, started_at_ms, finished_at_ms, executor_handle,
        log_artifact_id, callback_sequence, callback_token_digest, exit_code, error_code)
SELECT attempt_id, run_id, 1,
       CASE kind WHEN 'retry_wait' THEN 'failed' ELSE kind END, 'remote_worker', worker_id,
       session_id, generation, offer_id, 1, CASE kind WHEN 'running' THEN 1 ELSE 2 END,
       digest, created + 100, created + 150, created + 200,
       CASE kind WHEN 'running' THEN NULL WHEN 'retry_wait' THEN created + 1200
                 ELSE created + 30200 END,
       'pid:' || (1000 + n %% 4000000) || ';start:' || n, 'log-' || n, 1,
       md5('callback' || n) || md5('digest' || n),
       CASE kind WHEN 'succeeded' THEN 0 WHEN 'running' THEN NULL ELSE 1 END,
       CASE WHEN kind IN ('failed', 'retry_wait') THEN 'EXECUTION_FAILED' END
  FROM bulk_plan WHERE attempt_id IS NOT NULL
"""

_LEASES = """
INSERT INTO qinglong.run_leases
       (attempt_id, run_id, worker_id, session_id, worker_generation, offer_id,
        lease_generation, token_digest, version, status, acquired_at_ms, renewed_at_ms,
        expires_at_ms, ended_at_ms)
SELECT attempt_id, run_id, worker_id, session_id, generation, offer_id, 1, digest,
       CASE kind WHEN 'running' THEN 1 ELSE 2 END,
       CASE kind WHEN 'running' THEN 'leased' ELSE 'completed' END,
       created + 100,
       CASE kind WHEN 'running' THEN %(now)s WHEN 'retry_wait' THEN created + 1200
                 ELSE created + 30200 END,
       CASE kind WHEN 'running' THEN %(now)s + %(not_due)s WHEN 'retry_wait' THEN created + 1200
                 ELSE created + 30200 END,
       CASE kind WHEN 'running' THEN NULL WHEN 'retry_wait' THEN created + 1200
                 ELSE created + 30200 END
  FROM bulk_plan WHERE attempt_id IS NOT NULL
"""

# Each kind's Events, as the commands append them (placement, the start facts,
# completion, cancellation and convergence). One INSERT per sequence number: the gapless
# trigger checks every Event against the ones before it.
_EVENTS = """
INSERT INTO qinglong.run_events
       (event_id, run_id, sequence, event_type, attempt_id, actor_kind, actor_id,
        occurred_at_ms, payload, dedupe_key)
SELECT gen_random_uuid(), p.run_id, script.sequence, script.event_type,
       CASE WHEN script.of_attempt THEN p.attempt_id END, script.actor_kind,
       CASE script.actor_kind WHEN 'worker' THEN p.worker_id WHEN 'user' THEN 'bulk-operator'
                              ELSE 'convergence' END,
       p.created + script.after_ms, script.payload::jsonb,
       CASE WHEN script.event_type = 'run.cancel_requested'
            THEN 'cancel:' || p.run_id || ':bulk' END
  FROM bulk_plan p
  JOIN (VALUES
      ('*', 1, 'run.queued', false, 'user', 0, '{"from_state": "created", "to_state": "queued"}'),
      ('cancelled', 2, 'run.cancel_requested', false, 'user', 500,
       '{"reason": "user", "requested_at_ms": 0}'),
      ('cancelled', 3, 'run.cancelled', false, 'reconciler', 600,
       '{"from_state": "queued", "to_state": "cancelled", "error_code": "EXECUTION_CANCELLED"}'),
      ('started', 2, 'attempt.claimed', true, 'worker', 100,
       '{"lease_generation": 1, "attempt_number": 1}'),
      ('started', 3, 'run.dispatching', true, 'worker', 100,
       '{"from_state": "queued", "to_state": "dispatching"}'),
      ('started', 4, 'attempt.starting', true, 'worker', 150, '{"timeout_ms": null}'),
      ('started', 5, 'attempt.running', true, 'worker', 200, '{"log_artifact_id": "log"}'),
      ('started', 6, 'run.running', true, 'worker', 200,
       '{"from_state": "dispatching", "to_state": "running"}'),
      ('succeeded', 7, 'attempt.succeeded', true, 'worker', 30200,
       '{"state": "succeeded", "error_code": null, "exit_code": 0}'),
      ('succeeded', 8, 'run.succeeded', true, 'worker', 30200,
       '{"from_state": "running", "to_state": "succeeded", "attempt_number": 1}'),
      ('failed', 7, 'attempt.failed', true, 'worker', 30200,
       '{"state": "failed", "error_code": "EXECUTION_FAILED", "exit_code": 1}'),
      ('failed', 8, 'run.failed', true, 'worker', 30200,
       '{"from_state": "running", "to_state": "failed", "error_code": "EXECUTION_FAILED"}'),
      ('retry_wait', 7, 'attempt.failed', true, 'worker', 1200,
       '{"state": "failed", "error_code": "EXECUTION_FAILED", "exit_code": 1}'),
      ('retry_wait', 8, 'run.retry_wait', true, 'worker', 1200,
       '{"from_state": "running", "to_state": "retry_wait", "attempt_number": 1}')
       ) AS script (kind, sequence, event_type, of_attempt, actor_kind, after_ms, payload)
    ON script.kind = p.kind OR script.kind = '*'
       OR (script.kind = 'started' AND p.kind IN ('succeeded', 'failed', 'retry_wait', 'running'))
 WHERE script.sequence = %(sequence)s
 ORDER BY p.run_id
"""

_BULK_TABLES = ("runs", "offers", "attempts", "run_leases", "run_events", "worker_sessions")


def _db_now(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT qinglong.db_now_ms()").fetchone()
    assert row is not None
    now: int = row[0]
    return now


def _enroll_bulk(conn: psycopg.Connection[Any], people: Population, now: int) -> None:
    """Project, tasks, Workers and Sessions the bulk Runs point at."""
    ensure_project(conn, BULK_PROJECT, BULK_PROJECT)
    for index in range(people.workers):
        worker = f"bulk-{index:04d}"
        enroll_worker(conn, worker, f"spiffe://qinglong.local/worker/{worker}")
    shape = {"project": BULK_PROJECT, "tasks": BULK_TASKS, "workers": people.workers}
    conn.execute(_BULK_TASKS, shape)
    conn.execute(_BULK_REVISIONS, shape)
    conn.execute(
        _CLOSED_SESSIONS,
        {**shape, "sessions": people.closed_sessions, "since": now - 30 * 86_400_000},
    )
    conn.execute(
        _LIVE_SESSIONS,
        {**shape, "generation": people.live_generation, "now": now, "not_due": NOT_DUE_FOR_MS},
    )


@dataclass(frozen=True)
class Database:
    people: Population
    urls: RoleUrls
    loaded_at_ms: int

    @property
    def name(self) -> str:
        return self.people.name


def create_database(admin_url: str, people: Population) -> Database:
    """A migrated database with bench_ack's project and Worker, and the bulk Workers."""
    urls = bootstrap_database(admin_url, f"qinglong_scale_{people.name}")
    bench_ack.prepare_database(urls.migration)
    with psycopg.connect(urls.migration, autocommit=True) as conn:
        now = _db_now(conn)
        _enroll_bulk(conn, people, now)
    return Database(people, urls, now)


@dataclass(frozen=True)
class Batch:
    database: Database
    low: int
    high: int


def _load_batch(batch: Batch) -> int:
    """Load one batch in one transaction; returns how many Runs it loaded."""
    people = batch.database.people
    values = {
        "project": BULK_PROJECT,
        "tasks": BULK_TASKS,
        "workers": people.workers,
        "per_session": ATTEMPTS_PER_SESSION,
        "live_generation": people.live_generation,
        "terminal": people.terminal,
        "first_running": people.terminal + people.waiting,
        "runs": people.runs,
        "now": batch.database.loaded_at_ms,
        "not_due": NOT_DUE_FOR_MS,
        "low": batch.low,
        "high": batch.high,
    }
    with psycopg.connect(batch.database.urls.migration, autocommit=True) as conn:
        # The load's commits need not wait for the disk; the measured commands' do.
        conn.execute("SET synchronous_commit = off")
        conn.execute(_PLAN)
        with conn.transaction():
            conn.execute(_FILL_PLAN, values)
            for statement in (_RUNS, _OFFERS, _ATTEMPTS, _LEASES):
                conn.execute(statement, values)
            for sequence in range(1, 9):
                conn.execute(_EVENTS, {"sequence": sequence})
    return batch.high - batch.low


def _vacuum(job: tuple[Database, str]) -> None:
    database, table = job
    with psycopg.connect(database.urls.migration, autocommit=True) as conn:
        conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(sql.Identifier("qinglong", table)))


def bulk_load(databases: Sequence[Database], loaders: int) -> float:
    """Load every database's population as the schema owner, every constraint and trigger
    in force, `loaders` batches at a time (each batch is its own transaction and touches
    Runs no other batch does); then vacuum and analyze, as autovacuum would have by the
    time such a history exists. Returns seconds."""
    started = time.perf_counter()
    batches = [
        Batch(database, low, min(database.people.runs, low + LOAD_BATCH))
        for database in databases
        for low in range(0, database.people.runs, LOAD_BATCH)
    ]
    done = 0
    with ThreadPoolExecutor(loaders) as pool:
        for loaded in pool.map(_load_batch, batches):
            done += loaded
            elapsed = time.perf_counter() - started
            print(f"  loaded {done:,} Runs in {elapsed:.0f} s", file=sys.stderr, flush=True)
        list(pool.map(_vacuum, [(db, table) for db in databases for table in _BULK_TABLES]))
    return time.perf_counter() - started


def database_size(database: Database) -> str:
    with psycopg.connect(database.urls.migration) as conn:
        row = conn.execute("SELECT pg_size_pretty(pg_database_size(current_database()))")
        size = row.fetchone()
    return "?" if size is None else str(size[0])


# --- shared measuring helpers ------------------------------------------------------------------


@dataclass
class Figure:
    samples: list[float]  # milliseconds

    @property
    def p50(self) -> float:
        return percentiles.p50(self.samples)

    @property
    def p99(self) -> float:
        return percentiles.p99(self.samples)


async def timed(call: Awaitable[_T]) -> tuple[_T, float]:
    """The awaited result and how long it took, in milliseconds."""
    started = time.perf_counter()
    result = await call
    return result, (time.perf_counter() - started) * 1000.0


def figures_table(
    title: str,
    rows: Sequence[str],
    columns: Sequence[str],
    figures: dict[tuple[str, str], Figure],
    ratios: Sequence[tuple[str, str]],
) -> str:
    """p50/p99 of each row per column, then each (over, under) ratio of two columns' p50."""
    head = f"{title:34}" + "".join(f" {column + ' p50':>13} {'p99':>8}" for column in columns)
    head += "".join(f" {f'{over}/{under}':>14}" for over, under in ratios)
    lines = [head]
    for row in rows:
        line = f"{row:34}"
        for column in columns:
            figure = figures.get((row, column))
            line += " " * 23 if figure is None else f" {figure.p50:13.3f} {figure.p99:8.3f}"
        for over, under in ratios:
            if (row, over) in figures and (row, under) in figures:
                ratio = figures[(row, over)].p50 / figures[(row, under)].p50
                line += f" {ratio:13.2f}x"
        lines.append(line)
    return "\n".join(lines)


# --- 1. AcknowledgeRunning ---------------------------------------------------------------------

#: Work is pulled this many Runs at a time, as a busy Worker pulls several offers at once;
#: it divides bench_ack.ITERATIONS_PER_SESSION, so Sessions rotate on a batch boundary.
CLAIM_BATCH = 30
_A_BULK_TASK = """
SELECT task_id FROM qinglong.tasks
 WHERE project_id = %(project)s ORDER BY create_request_id LIMIT 1
"""
PREPARATION = ("PullOffers (prep, x30)", "ClaimOffer (prep)", "AcknowledgeStarting (prep)")
ACK = "AcknowledgeRunning"


class BacklogPreparer(bench_ack.Preparer):
    """bench_ack's Preparer, fed from the backlog instead of by name: placement offers the
    oldest queued Runs (on a loaded database, those the load left waiting), and for every
    Run it takes a new one of a bulk task is triggered, so the backlog keeps its size and
    every database acknowledges the same kind of Run. Fences are claimed and acknowledged
    `starting` a batch at a time; the preparation's own latencies are kept for the record."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        super().__init__(conn)
        # A new Session generation every ITERATIONS_PER_SESSION fences keeps the live
        # Attempts under its capacity (the parent's rule, counted in batches here).
        assert bench_ack.ITERATIONS_PER_SESSION % CLAIM_BATCH == 0
        self.ready: list[Fence] = []
        self.preparation: dict[str, list[float]] = {name: [] for name in PREPARATION}

    async def setup(self) -> None:
        """Runs of a bulk task (the load made it), not of a task of bench_ack's own."""
        cursor = await self.conn.execute(_A_BULK_TASK, {"project": BULK_PROJECT})
        row = await cursor.fetchone()
        assert row is not None, "the bulk load made no task"
        self.task_id = row[0]

    async def next_starting(self) -> Fence:
        while not self.ready:
            await self._claim_batch()
        return self.ready.pop(0)

    async def _claim_batch(self) -> None:
        assert self.task_id is not None
        session = await self._session()
        self.prepared += CLAIM_BATCH
        for _ in range(CLAIM_BATCH):
            request = runs.TriggerRun(BULK_PROJECT, self.task_id, None, uuid.uuid4().hex)
            await runs.trigger_run(self.conn, request, bench_ack.OPERATOR)
        pulled, pull_ms = await timed(
            placement.pull_offers(self.conn, session, CLAIM_BATCH, bench_ack.TIMINGS)
        )
        self.preparation[PREPARATION[0]].append(pull_ms)
        for offer in pulled.offers:
            fence, claim_ms = await timed(self._claim(session, offer))
            starting, starting_ms = await timed(acknowledge_starting(self.conn, fence))
            assert starting.writes, starting
            self.preparation[PREPARATION[1]].append(claim_ms)
            self.preparation[PREPARATION[2]].append(starting_ms)
            self.ready.append(fence)


async def measure_acks(
    databases: Sequence[Database], iterations: int, warmup: int, seed: int
) -> dict[tuple[str, str], Figure]:
    """AcknowledgeRunning on every database, interleaved in a shuffled order per iteration."""
    shuffle = random.Random(seed)
    figures: dict[tuple[str, str], Figure] = {}
    async with AsyncExitStack() as stack:
        preparers: dict[str, BacklogPreparer] = {}
        for database in databases:
            conn = await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True)
            await stack.enter_async_context(conn)
            preparers[database.name] = BacklogPreparer(conn)
            await preparers[database.name].setup()
            figures[(ACK, database.name)] = Figure([])
        for iteration in range(warmup + iterations):
            work = [(name, await p.next_starting()) for name, p in preparers.items()]
            shuffle.shuffle(work)
            for name, fence in work:
                command = acknowledge_running(preparers[name].conn, fence, bench_ack.REPORT)
                decision, elapsed = await timed(command)
                assert decision.writes, decision
                if iteration >= warmup:
                    figures[(ACK, name)].samples.append(elapsed)
        for name, preparer in preparers.items():
            for row, samples in preparer.preparation.items():
                figures[(row, name)] = Figure(samples)
    return figures


# --- 2. the reconciler's cycle -----------------------------------------------------------------

CYCLE = "Reconciler.cycle()"
#: What the service's reconciler connection carries (db/pool.py): its session settings
#: and the default storage bounds.
_RECONCILER_CONNECTION: dict[str, Any] = StorageBounds().connection_kwargs(
    "bench-reconciler", RECONCILER_SETTINGS
)


@dataclass
class Cycler:
    """One database's Reconciler (on a one-connection pool with the service reconciler's
    session settings, as the service has) and a connection of its own, with the same
    settings, for timing each step alone."""

    reconciler: Reconciler
    conn: psycopg.AsyncConnection[Any]
    busy_cycles: int = 0

    def steps(self) -> list[tuple[str, Callable[[], Awaitable[object]]]]:
        """The whole cycle, then each of its steps alone (the Reconciler's own list, so a
        step added to the cycle is timed here without being named twice)."""
        alone = [*self.reconciler.steps(self.conn), self.reconciler.output_step()]
        return [(CYCLE, self._cycle), *((f"  {step.name}", step.page) for step in alone)]

    async def _cycle(self) -> CycleReport:
        report = await self.reconciler.cycle()
        if report != CycleReport(0, 0, 0, report.pages):
            self.busy_cycles += 1  # it found work: not the steady state being measured
        return report


async def measure_cycles(
    databases: Sequence[Database], cycles: int, warmup: int, seed: int
) -> tuple[dict[tuple[str, str], Figure], dict[str, int]]:
    shuffle = random.Random(seed)
    limits = ReconcilerLimits()
    figures: dict[tuple[str, str], Figure] = {}
    async with AsyncExitStack() as stack:
        cyclers: dict[str, Cycler] = {}
        for database in databases:
            pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
                database.urls.runtime,
                min_size=1,
                max_size=1,
                kwargs=_RECONCILER_CONNECTION,
                open=False,
            )
            await pool.open(wait=True)
            stack.push_async_callback(pool.close)
            conn = await psycopg.AsyncConnection.connect(
                database.urls.runtime, **_RECONCILER_CONNECTION
            )
            await stack.enter_async_context(conn)
            cyclers[database.name] = Cycler(Reconciler(pool, limits), conn)
        for name, cycler in cyclers.items():  # the table's rows in the cycle's order
            figures.update(((row, name), Figure([])) for row, _ in cycler.steps())
        for iteration in range(warmup + cycles):
            work = [
                (name, row, step)
                for name, cycler in cyclers.items()
                for row, step in cycler.steps()
            ]
            shuffle.shuffle(work)
            for name, row, step in work:
                _, elapsed = await timed(step())
                if iteration >= warmup:
                    figures[(row, name)].samples.append(elapsed)
    return figures, {name: cycler.busy_cycles for name, cycler in cyclers.items()}


# --- 3. the Worker daemon's memory -------------------------------------------------------------

MIB = 1024 * 1024
#: The contract's bound on a Session's max_concurrent_attempts: one daemon never
#: supervises more Attempts at once.
WORKER_CONCURRENCY = MAX_CONCURRENT_ATTEMPTS_MAX
#: Long enough for several ticks (0.5 s) and lease-control rounds (2 s) between samples.
SETTLE_SECONDS = 6.0
RSS_SAMPLES = 12
WAIT_TIMEOUT_SECONDS = 900.0
#: The daemon's own cadences (tests/support/worker_process.py runs faster ones), and no
#: drain grace, so stopping a daemon never waits.
DAEMON_FLAGS = (
    "--tick-seconds",
    str(DEFAULT_TICK_SECONDS),
    "--lease-control-seconds",
    str(DEFAULT_LEASE_CONTROL_SECONDS),
    "--drain-grace-seconds",
    "0",
)
_RUN_STATES = """
SELECT count(*) FILTER (WHERE state = 'running'),
       count(*) FILTER (WHERE state = %s),
       count(*) FILTER (WHERE state <> %s AND finished_at_ms IS NOT NULL)
  FROM qinglong.runs WHERE task_id = %s
"""


@dataclass(frozen=True)
class Memory:
    rss: int
    pss: int
    uss: int


def memory_of(pid: int) -> Memory:
    info = psutil.Process(pid).memory_full_info()
    return Memory(info.rss, info.pss, info.uss)


def settled_rss(pid: int) -> float:
    """The median of RSS_SAMPLES samples over SETTLE_SECONDS, in MiB."""
    samples = []
    for _ in range(RSS_SAMPLES):
        time.sleep(SETTLE_SECONDS / RSS_SAMPLES)
        samples.append(float(psutil.Process(pid).memory_info().rss) / MIB)
    return statistics.median(samples)


class Operator:
    """Tasks and Runs through ingress, with the stack's operator certificate and token."""

    def __init__(self, stack: DevStack, channel: grpc.aio.Channel) -> None:
        self.project = stack.project_id
        self.tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        self.runs = run_service_pb2_grpc.RunServiceStub(channel)
        self.meta = (("authorization", "Bearer " + stack.operator_token),)

    async def task(self, command: Sequence[str]) -> str:
        created = await self.tasks.CreateTask(
            task_service_pb2.CreateTaskRequest(
                project_id=self.project, request_id=uuid.uuid4().hex, display_name="scale"
            ),
            metadata=self.meta,
        )
        await self.tasks.CreateTaskRevision(
            task_service_pb2.CreateTaskRevisionRequest(
                project_id=self.project,
                task_id=created.task.task_id,
                request_id=uuid.uuid4().hex,
                plan=execution_pb2.ExecutionPlan(
                    executor_type=execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER,
                    command=list(command),
                    timeout_ms=3_600_000,
                ),
            ),
            metadata=self.meta,
        )
        return str(created.task.task_id)

    async def trigger(self, command: Sequence[str], count: int) -> tuple[str, list[str]]:
        """`count` Runs of a new task running `command`: (task id, Run ids)."""
        task_id = await self.task(command)
        run_ids = []
        for _ in range(count):
            answer = await self.runs.TriggerRun(
                run_service_pb2.TriggerRunRequest(
                    project_id=self.project, task_id=task_id, request_id=uuid.uuid4().hex
                ),
                metadata=self.meta,
            )
            run_ids.append(answer.run.run_id)
        return task_id, run_ids

    async def cancel(self, run_ids: Sequence[str]) -> None:
        for run_id in run_ids:
            await self.runs.CancelRun(
                run_service_pb2.CancelRunRequest(
                    project_id=self.project, run_id=run_id, mutation_id=uuid.uuid4().hex
                ),
                metadata=self.meta,
            )


def wait_for_runs(
    stack: DevStack, task_id: str, *, running: int = 0, ended: int = 0, ending: str = "succeeded"
) -> None:
    """Until the task has at least `running` running and `ended` ended Runs; every ended
    one must have ended `ending` (anything else means the Worker was not doing its job)."""
    deadline = time.monotonic() + WAIT_TIMEOUT_SECONDS
    with psycopg.connect(stack.migration_url, autocommit=True) as conn:
        while True:
            row = conn.execute(_RUN_STATES, (ending, ending, uuid.UUID(task_id))).fetchone()
            assert row is not None
            now_running, now_ended, otherwise = row
            if otherwise:
                raise RuntimeError(f"{otherwise} Run(s) of task {task_id} did not end {ending}")
            if now_running >= running and now_ended >= ended:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"task {task_id}: {now_running} running, {now_ended} ended")
            time.sleep(0.25)


@contextmanager
def worker_daemon(stack: DevStack, inbox: Path) -> Iterator[WorkerProcess]:
    """A `qinglong-worker run` process of its own (a fresh inbox, a new Session), so each
    figure starts from a baseline no earlier work has raised: Python keeps the memory it
    once used, so a daemon's RSS only tells the high-water mark of what it did so far."""
    worker = WorkerProcess(
        stack,
        inbox,
        address=stack.ingress_address,
        max_concurrency=WORKER_CONCURRENCY,
        extra_flags=DAEMON_FLAGS,
    ).start()
    try:
        if not worker.ready() or not worker.alive():
            raise RuntimeError("the Worker did not start")
        yield worker
    except BaseException:
        print(worker.log_tail(), file=sys.stderr)
        raise
    finally:
        worker.stop()


async def warmed_up_rss(operator: Operator, stack: DevStack, pid: int, warmup: int) -> float:
    """The daemon's idle RSS after `warmup` Attempts ran: the first Attempts pay for
    first-use allocations (stubs, code paths, caches) no later Attempt pays again."""
    task_id, _ = await operator.trigger(["true"], warmup)
    wait_for_runs(stack, task_id, ended=warmup)
    return settled_rss(pid)


#: Attempts running at once at each step of daemon 1: the slope over the steps is what
#: one more supervised Attempt costs, apart from what any concurrency costs once.
CONCURRENCY_STEPS = (16, 32, 48, WORKER_CONCURRENCY)


@dataclass(frozen=True)
class WorkerMemory:
    warmup: int
    attempts: int
    started: float
    running: list[tuple[int, float]]
    """(Attempts running at once, RSS MiB), from the warmed-up idle (0) to 64."""
    supervisors: list[Memory]
    churn_idle: float
    after_churn: float

    @property
    def slope_per_1000(self) -> float:
        """Least-squares MiB per running Attempt over the steps, x 1,000."""
        xs = [float(count) for count, _ in self.running]
        ys = [rss for _, rss in self.running]
        return statistics.linear_regression(xs, ys).slope * 1000

    @property
    def churn_per_1000(self) -> float:
        return (self.after_churn - self.churn_idle) * 1000 / self.attempts


async def step_up_running(
    operator: Operator, stack: DevStack, pid: int
) -> tuple[list[tuple[int, float]], list[Memory], list[tuple[str, list[str]]]]:
    """Raise the daemon's running Attempts step by step, sampling its RSS at each step and
    the supervisors' memory at the last; returns the points, the supervisors and what to
    cancel afterwards."""
    points: list[tuple[int, float]] = []
    batches: list[tuple[str, list[str]]] = []
    for target in CONCURRENCY_STEPS:
        already = sum(len(run_ids) for _, run_ids in batches)
        batch = await operator.trigger(["sleep", "3600"], target - already)
        batches.append(batch)
        wait_for_runs(stack, batch[0], running=len(batch[1]), ending="cancelled")
        points.append((target, settled_rss(pid)))
    supervisors = [memory_of(child.pid) for child in psutil.Process(pid).children()]
    return points, supervisors, batches


async def measure_worker(root: Path, attempts: int, warmup: int) -> WorkerMemory:
    with dev_stack(root / "stack") as stack:
        channel = grpc.aio.secure_channel(
            stack.ingress_address, mutual_tls_channel_credentials(stack.operator_tls)
        )
        try:
            operator = Operator(stack, channel)
            with worker_daemon(stack, root / "worker-concurrent" / "inbox.sqlite") as worker:
                started = settled_rss(worker.pid)
                idle = await warmed_up_rss(operator, stack, worker.pid, warmup)
                points, supervisors, batches = await step_up_running(operator, stack, worker.pid)
                for _, run_ids in batches:
                    await operator.cancel(run_ids)
                for task_id, run_ids in batches:
                    wait_for_runs(stack, task_id, ended=len(run_ids), ending="cancelled")
            with worker_daemon(stack, root / "worker-churn" / "inbox.sqlite") as worker:
                churn_idle = await warmed_up_rss(operator, stack, worker.pid, warmup)
                task_id, _ = await operator.trigger(["true"], attempts)
                wait_for_runs(stack, task_id, ended=attempts)
                after_churn = settled_rss(worker.pid)
        finally:
            await channel.close()
    running = [(0, idle), *points]
    return WorkerMemory(warmup, attempts, started, running, supervisors, churn_idle, after_churn)


def worker_table(memory: WorkerMemory) -> str:
    idle = memory.running[0][1]
    rows = [("daemon 1: right after start (Session open)", memory.started, "")]
    rows.append((f"daemon 1: idle after a {memory.warmup}-Attempt warm-up", idle, "baseline"))
    for count, rss in memory.running[1:]:
        per_1000 = (rss - idle) * 1000 / count
        note = f"{per_1000:+.2f} MiB per 1,000 (growth / {count} x 1,000)"
        rows.append((f"daemon 1: {count} Attempts running `sleep` at once", rss, note))
    rows.append(
        (f"daemon 2: idle after a {memory.warmup}-Attempt warm-up", memory.churn_idle, "baseline")
    )
    rows.append(
        (
            f"daemon 2: idle after {memory.attempts:,} more Attempts ran to completion",
            memory.after_churn,
            f"{memory.churn_per_1000:+.2f} MiB per 1,000 (growth x 1,000 / {memory.attempts:,})",
        )
    )
    lines = [f"{'qinglong-worker run, --max-concurrency 64':60} {'RSS MiB':>8}"]
    lines += [f"{name:60} {rss:8.1f}  {note}".rstrip() for name, rss, note in rows]
    if memory.supervisors:
        count = len(memory.supervisors)
        rss = statistics.mean(m.rss for m in memory.supervisors) / MIB
        pss = statistics.mean(m.pss for m in memory.supervisors) / MIB
        uss = statistics.mean(m.uss for m in memory.supervisors) / MIB
        lines.append(
            f"\nsupervisor processes ({count}, one per running Attempt, outside the daemon):"
            f" mean RSS {rss:.1f} MiB, PSS {pss:.1f} MiB, USS {uss:.1f} MiB;"
            f" 1,000 of them would hold {pss * 1000 / 1024:.1f} GiB (PSS)"
        )
    lines.append(
        f"\ndaemon RSS per 1,000 Attempts (target <= 8 MiB): {memory.slope_per_1000:.2f} MiB"
        f" supervised at once (least-squares slope over 0..{memory.running[-1][0]}, x 1,000),"
        f" {memory.churn_per_1000:.2f} MiB left after {memory.attempts:,} completed"
    )
    return "\n".join(lines)


# --- the run -------------------------------------------------------------------------------------

_SERVER_SETTINGS = """
SELECT current_setting('server_version'), current_setting('shared_buffers'),
       current_setting('fsync'), current_setting('synchronous_commit')
"""

#: The statements each figure rests on, with sample parameters, for --explain.
_EXPLAINED = (
    ("convergence.expired_leases", (128,)),
    ("convergence.lock_candidates", {"limit": 128}),
    ("retries.lock_lost", {"limit": 128}),
    ("retries.lock_due", {"limit": 128}),
)
_A_RUNNING_RUN = """
SELECT a.attempt_id, a.session_id, r.run_id FROM qinglong.runs r
  JOIN qinglong.attempts a ON a.run_id = r.run_id AND a.state = 'running'
 LIMIT 1
"""


_RUNNING_ONLY = {
    "task_id": None,
    "states": ["running"],
    "before_created": None,
    "before_run": None,
    "limit": 51,
}


def explain(database: Database) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of the cycle's reads, of two reads of every ACK or
    claim and of a filtered listing, as the runtime role, rolled back (the FOR UPDATE ones
    take row locks)."""
    lines = [f"--- {database.name}: {database.people.describe()}"]
    with psycopg.connect(database.urls.runtime) as conn:
        row = conn.execute(_A_RUNNING_RUN).fetchone()
        assert row is not None
        attempt_id, session_id, run_id = row
        explained: list[tuple[str, Any]] = [
            *_EXPLAINED,
            # A fenced command's locks (migration 0012): EXPLAIN shows the function's time,
            # not the plans of the statements inside it.
            ("authority.lock_authority", (attempt_id, session_id, run_id)),
            ("placement.session_room", (session_id,)),
            # An operator's listing (`qinglong run list --state running`): by migration
            # 0020's index, not every Run of the project.
            ("runs.list_runs", _RUNNING_ONLY | {"project_id": BULK_PROJECT}),
        ]
        for name, params in explained:
            plan = conn.execute(
                sql.SQL("EXPLAIN (ANALYZE, BUFFERS) ") + sql.SQL(SQL[name]), params
            ).fetchall()
            lines.append(f"{name}:")
            lines += [f"    {line}" for (line,) in plan]
        conn.rollback()
    return "\n".join(lines)


@dataclass(frozen=True)
class Options:
    runs: int
    baseline_runs: int
    terminal_percent: float
    pending: int
    baseline_pending: int
    iterations: int
    cycles: int
    warmup: int
    worker_attempts: int
    worker_warmup: int
    loaders: int
    postgres: int
    seed: int
    parts: frozenset[str]
    explain: bool

    def populations(self) -> list[Population]:
        """`small`: the baseline of both database figures; `large`: the history; `pending`:
        the baseline's history with `pending` waiting Runs and as many live leases."""
        baseline = self.baseline_pending
        small = population("small", self.baseline_runs, baseline, baseline)
        wanted = [small]
        if "ack" in self.parts:
            unfinished = round(self.runs * (100 - self.terminal_percent) / 100)
            wanted.append(population("large", self.runs, unfinished // 2, unfinished // 2))
        if "cycle" in self.parts:
            pending = self.pending
            wanted.append(population("pending", small.terminal + 2 * pending, pending, pending))
        return wanted


async def measure_database(options: Options, root: Path) -> list[str]:
    server = start_embedded_postgres(root / "postgres", options.postgres, delete_on_exit=True)
    try:
        return await _measure_on(server, options)
    finally:
        server.stop()


async def _measure_on(server: EmbeddedPostgres, options: Options) -> list[str]:
    with psycopg.connect(server.admin_url, autocommit=True) as admin:
        row = admin.execute(_SERVER_SETTINGS).fetchone()
        assert row is not None
        version, shared_buffers, fsync, synchronous_commit = row
    databases = [create_database(server.admin_url, p) for p in options.populations()]
    load_seconds = bulk_load(databases, options.loaders)
    with psycopg.connect(server.admin_url, autocommit=True) as admin:
        admin.execute("CHECKPOINT")  # the load's dirty pages are written before measuring
    out = [
        f"PostgreSQL {version} embedded, Unix socket; shared_buffers={shared_buffers},"
        f" fsync={fsync}, synchronous_commit={synchronous_commit}",
        f"bulk load {load_seconds:.0f} s ({options.loaders} loaders, vacuum and analyze included):",
    ]
    out += [f"  {db.name:8} {db.people.describe()}; {database_size(db)}" for db in databases]
    if options.explain:
        out += [explain(db) for db in databases if db.name != "small" or len(databases) == 1]
    by_name = {db.name: db for db in databases}
    if "cycle" in options.parts:
        out.append(await _cycle_section(options, databases))
    if "ack" in options.parts:
        out.append(await _ack_section(options, [by_name["small"], by_name["large"]]))
    return out


async def _cycle_section(options: Options, databases: Sequence[Database]) -> str:
    cycled = [db for db in databases if db.name in ("small", "pending", "large")]
    figures, busy = await measure_cycles(cycled, options.cycles, options.warmup, options.seed)
    names = [db.name for db in cycled]
    ratios = [(name, "small") for name in names if name != "small"]
    rows = list(dict.fromkeys(row for row, _ in figures))
    table = figures_table("cycle, nothing due (ms)", rows, names, figures, ratios)
    busy_note = ", ".join(f"{name} {count}" for name, count in busy.items())
    target = ""
    if "pending" in names:
        ratio = figures[(CYCLE, "pending")].p50 / figures[(CYCLE, "small")].p50
        target = f"\ncycle p50 pending / small = {ratio:.2f}x (target <= 1.2x)"
    return (
        f"\n2. reconciler cycle, {options.cycles} interleaved cycles per database"
        f" (+{options.warmup} warm-up)\n{table}\ncycles that found work: {busy_note}{target}"
    )


async def _ack_section(options: Options, databases: Sequence[Database]) -> str:
    figures = await measure_acks(databases, options.iterations, options.warmup, options.seed)
    table = figures_table(
        "command (ms)", (ACK, *PREPARATION), ["small", "large"], figures, [("large", "small")]
    )
    ratio = figures[(ACK, "large")].p50 / figures[(ACK, "small")].p50
    return (
        f"\n1. AcknowledgeRunning, {options.iterations} interleaved iterations per database"
        f" (+{options.warmup} warm-up); runtime role, autocommit AsyncConnection each"
        f"\n{table}\nAcknowledgeRunning p50 large / small = {ratio:.2f}x (target <= 1.1x)"
    )


def run(options: Options) -> str:
    begun = time.perf_counter()
    out: list[str] = []
    with tempfile.TemporaryDirectory(prefix="qinglong-scale-") as tmp:
        root = Path(tmp)
        if options.parts & {"ack", "cycle"}:
            out += asyncio.run(measure_database(options, root))
        if "worker" in options.parts:
            memory = asyncio.run(
                measure_worker(root, options.worker_attempts, options.worker_warmup)
            )
            out.append(f"\n3. Worker daemon memory, on the dev stack\n{worker_table(memory)}")
    out.append(f"\nwall time {time.perf_counter() - begun:.0f} s")
    return "\n".join(out)


def parse(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=1_000_000, help="Runs in `large`")
    parser.add_argument("--baseline-runs", type=int, default=1_000, help="Runs in `small`")
    parser.add_argument("--terminal-percent", type=float, default=99.0, help="of `large`")
    parser.add_argument(
        "--pending", type=int, default=100_000, help="waiting Runs and live leases in `pending`"
    )
    parser.add_argument("--baseline-pending", type=int, default=10, help="the same in `small`")
    parser.add_argument("--iterations", type=int, default=300, help="ACKs per database")
    parser.add_argument("--cycles", type=int, default=300, help="cycles per database")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--worker-attempts", type=int, default=1_000)
    parser.add_argument("--worker-warmup", type=int, default=16)
    parser.add_argument("--loaders", type=int, default=2, help="bulk-load connections")
    parser.add_argument("--postgres", type=int, choices=(16, 18), default=18)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--parts", default="ack,cycle,worker")
    parser.add_argument(
        "--explain", action="store_true", help="print the plans the figures rest on"
    )
    args = parser.parse_args(argv)
    parts = frozenset(part.strip() for part in args.parts.split(",") if part.strip())
    if not parts or not parts <= {"ack", "cycle", "worker"}:
        parser.error("--parts is a comma-separated subset of ack,cycle,worker")
    if args.iterations < 10 or args.cycles < 10:
        parser.error("--iterations and --cycles must be at least 10")
    if not 2 * args.baseline_pending < args.baseline_runs <= args.runs:
        parser.error("need 2 x --baseline-pending < --baseline-runs <= --runs")
    if not 0 < args.terminal_percent < 100 or args.worker_attempts < 1:
        parser.error("--terminal-percent must be in (0, 100), --worker-attempts positive")
    return Options(
        runs=args.runs,
        baseline_runs=args.baseline_runs,
        terminal_percent=args.terminal_percent,
        pending=args.pending,
        baseline_pending=args.baseline_pending,
        iterations=args.iterations,
        cycles=args.cycles,
        warmup=args.warmup,
        worker_attempts=args.worker_attempts,
        worker_warmup=args.worker_warmup,
        loaders=args.loaders,
        postgres=args.postgres,
        seed=args.seed,
        parts=parts,
        explain=args.explain,
    )


def main(argv: list[str] | None = None) -> int:
    print(run(parse(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
