"""Latency of the three start facts, as a ratio to a minimal durable commit (issue 3).

Starts a throwaway embedded PostgreSQL, bootstraps the QingLong database, and runs each
ACK command in-process through the repository (`qinglong_control.db.start_facts`) on
fresh claimed work prepared outside the timed region. The baseline is the cheapest
durable write transaction possible on the same database and the same kind of connection:
BEGIN, a one-row UPDATE, one INSERT and COMMIT, pipelined into a single round trip.
All measurements are interleaved in a shuffled order per iteration, so they share noise.

    .venv/bin/python bench/bench_ack.py [--iterations 300] [--postgres 18]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import secrets
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from qinglong_cli.embedded_postgres import start_embedded_postgres
from qinglong_control.db import definitions, placement, runs, sessions
from qinglong_control.db.bootstrap import bootstrap_database
from qinglong_control.db.events import Actor
from qinglong_control.db.identities import enroll_worker, ensure_project
from qinglong_control.db.start_facts import (
    acknowledge_running,
    acknowledge_starting,
    report_start_failure,
)
from qinglong_control.domain.capability import digest_of_capability, parse_digest
from qinglong_control.domain.claim import ClaimRequest
from qinglong_control.domain.fence import Fence
from qinglong_control.domain.sessions import SessionClaim
from qinglong_control.domain.start_facts import RunningReport
from qinglong_control.domain.timings import Timings
from qinglong_protocol.bounds import encode_lease_capability

PROJECT = "bench"
WORKER = "bench-worker"
OPERATOR = Actor("user", "bench")
# Long enough that nothing prepared expires while the benchmark runs.
TIMINGS = Timings(session_ttl_ms=3_600_000, lease_ttl_ms=3_600_000, offer_ttl_ms=3_600_000)
REPORT = RunningReport("pid:4242;start:1700000000", "log-1", 1, parse_digest("ab" * 32))
# Live Attempts count against a session's concurrency: open a new generation this often.
SESSION_CAPACITY = 1024
ITERATIONS_PER_SESSION = 300

BASELINE = "minimal durable commit"
REFERENCE = "  same, one statement per round trip"
ACKS = ("acknowledge_starting", "acknowledge_running", "report_start_failure")

_BENCH_SCHEMA = """
CREATE SCHEMA bench;
CREATE TABLE bench.counter (id integer PRIMARY KEY, n bigint NOT NULL);
INSERT INTO bench.counter VALUES (1, 0);
CREATE TABLE bench.log (id uuid PRIMARY KEY, at_ms bigint NOT NULL, payload jsonb NOT NULL);
GRANT USAGE ON SCHEMA bench TO qinglong_runtime;
GRANT SELECT, UPDATE ON bench.counter TO qinglong_runtime;
GRANT INSERT ON bench.log TO qinglong_runtime;
"""

_UPDATE = "UPDATE bench.counter SET n = n + 1 WHERE id = 1"
_INSERT = "INSERT INTO bench.log (id, at_ms, payload) VALUES (%s, qinglong.db_now_ms(), %s)"


def prepare_database(migration_url: str) -> None:
    """Enrollment is the administrator's; the baseline tables live in their own schema."""
    with psycopg.connect(migration_url, autocommit=True) as admin:
        ensure_project(admin, PROJECT, PROJECT)
        enroll_worker(admin, WORKER, f"spiffe://qinglong.local/worker/{WORKER}")
        admin.execute(_BENCH_SCHEMA)


async def minimal_commit(conn: psycopg.AsyncConnection[Any]) -> None:
    async with conn.pipeline():
        await conn.execute("BEGIN")
        await conn.execute(_UPDATE)
        await conn.execute(_INSERT, (uuid.uuid4(), Jsonb({"bench": True})))
        await conn.execute("COMMIT")


async def statement_by_statement_commit(conn: psycopg.AsyncConnection[Any]) -> None:
    async with conn.transaction():
        await conn.execute(_UPDATE)
        await conn.execute(_INSERT, (uuid.uuid4(), Jsonb({"bench": True})))


@dataclass
class Work:
    """Claimed Runs for one iteration: one `claimed`, two already `starting`."""

    claimed: Fence
    starting: Fence
    failing: Fence


class Preparer:
    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self.task_id: uuid.UUID | None = None
        self.session: SessionClaim | None = None
        self.prepared = 0

    async def setup(self) -> None:
        task = await definitions.create_task(self.conn, PROJECT, "bench", {}, "task-1", "bench")
        await definitions.create_revision(
            self.conn,
            definitions.NewRevision(
                PROJECT, task.task_id, "rev-1", "remote_worker", ["true"], 600_000
            ),
            "bench",
        )
        self.task_id = task.task_id

    async def _session(self) -> SessionClaim:
        if self.session is None or self.prepared % ITERATIONS_PER_SESSION == 0:
            opened = await sessions.open_session(
                self.conn,
                sessions.OpenSession(
                    WORKER, uuid.uuid4().hex, ("remote_worker",), SESSION_CAPACITY, "bench"
                ),
                TIMINGS,
            )
            self.session = SessionClaim(WORKER, opened.session_id, opened.worker_generation)
        return self.session

    async def work(self) -> Work:
        assert self.task_id is not None
        session = await self._session()
        self.prepared += 1
        run_ids = [
            (
                await runs.trigger_run(
                    self.conn,
                    runs.TriggerRun(PROJECT, self.task_id, None, uuid.uuid4().hex),
                    OPERATOR,
                )
            ).run_id
            for _ in range(3)
        ]
        offers = await placement.pull_offers(self.conn, session, 8, TIMINGS)
        by_run = {offer.run_id: offer for offer in offers.offers}
        fences = [await self._claim(session, by_run[run_id]) for run_id in run_ids]
        for fence in fences[1:]:
            await acknowledge_starting(self.conn, fence)
        return Work(*fences)

    async def _claim(self, session: SessionClaim, offer: placement.PlacedOffer) -> Fence:
        digest = digest_of_capability(encode_lease_capability(secrets.token_bytes(32)))
        claimed = await placement.claim_offer(
            self.conn,
            ClaimRequest(
                WORKER,
                session.session_id,
                session.worker_generation,
                offer.offer_id,
                offer.project_id,
                offer.run_id,
                digest,
            ),
            TIMINGS,
        )
        return Fence(
            worker_id=WORKER,
            session_id=session.session_id,
            worker_generation=session.worker_generation,
            project_id=offer.project_id,
            run_id=offer.run_id,
            attempt_id=claimed.attempt_id,
            offer_id=offer.offer_id,
            lease_generation=claimed.lease_generation,
            token_digest=digest,
            expected_lease_version=claimed.lease_version,
        )


async def measure(
    conn: psycopg.AsyncConnection[Any], iterations: int, warmup: int, seed: int
) -> dict[str, list[float]]:
    preparer = Preparer(conn)
    await preparer.setup()
    shuffle = random.Random(seed)
    samples: dict[str, list[float]] = {name: [] for name in (BASELINE, REFERENCE, *ACKS)}
    for iteration in range(warmup + iterations):
        work = await preparer.work()
        commands: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            (BASELINE, partial(minimal_commit, conn)),
            (REFERENCE, partial(statement_by_statement_commit, conn)),
            (ACKS[0], partial(acknowledge_starting, conn, work.claimed)),
            (ACKS[1], partial(acknowledge_running, conn, work.starting, REPORT)),
            (ACKS[2], partial(report_start_failure, conn, work.failing, "exec: no such file")),
        ]
        shuffle.shuffle(commands)
        for name, command in commands:
            started = time.perf_counter()
            await command()
            elapsed = time.perf_counter() - started
            if iteration >= warmup:
                samples[name].append(elapsed * 1000)
    return samples


def report(samples: dict[str, list[float]], header: str) -> str:
    baseline = statistics.median(samples[BASELINE])
    lines = [
        header,
        f"{'command':<38}{'median ms':>10}{'p90 ms':>9}{'median / baseline':>19}",
    ]
    for name, values in samples.items():
        median = statistics.median(values)
        p90 = statistics.quantiles(values, n=10)[-1]
        lines.append(f"{name:<38}{median:>10.3f}{p90:>9.3f}{median / baseline:>18.2f}x")
    return "\n".join(lines)


async def run(iterations: int, warmup: int, version: int, seed: int) -> str:
    begun = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qinglong-bench-") as tmp:
        server = start_embedded_postgres(Path(tmp) / f"pg{version}", version, delete_on_exit=True)
        try:
            urls = bootstrap_database(server.admin_url, "qinglong_bench")
            prepare_database(urls.migration)
            conn = await psycopg.AsyncConnection.connect(urls.runtime, autocommit=True)
            async with conn:
                settings = await conn.execute(
                    "SELECT current_setting('server_version'), current_setting('fsync'),"
                    " current_setting('synchronous_commit'), current_setting('wal_sync_method')"
                )
                server_version, fsync, synchronous_commit, sync_method = (
                    await settings.fetchone() or ("?",) * 4
                )
                samples = await measure(conn, iterations, warmup, seed)
        finally:
            server.stop()
    header = (
        f"PostgreSQL {server_version} embedded, Unix socket; fsync={fsync},"
        f" synchronous_commit={synchronous_commit}, wal_sync_method={sync_method}\n"
        f"{iterations} interleaved iterations (+{warmup} warm-up), runtime role, one"
        f" autocommit psycopg AsyncConnection; wall time {time.perf_counter() - begun:.1f} s"
    )
    return report(samples, header)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--postgres", type=int, choices=(16, 18), default=18)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args(argv)
    if args.iterations < 10:
        parser.error("--iterations must be at least 10")
    print(asyncio.run(run(args.iterations, args.warmup, args.postgres, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
