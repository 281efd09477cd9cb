"""SPEC R-SEC-1 / §7.10: the lease capability plaintext never reaches the database.

A full flow runs (claims, the three start facts, replays, refusals, a cancelled start)
while libpq traces everything the runtime connection sends. Afterwards the catalog
drives a scan of every text, json/jsonb and bytea column of every table in schema
qinglong, every whole row, and every Event payload: none holds a capability used in the
flow, nor its secret part in any encoding. The scans are shown to work by finding the
digests where they belong.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import pq, sql
from qinglong_control.db import placement, runs
from qinglong_control.db.start_facts import (
    acknowledge_running,
    acknowledge_starting,
    report_start_failure,
)
from qinglong_control.domain.capability import digest_of_capability, parse_digest
from qinglong_control.domain.claim import ClaimRequest
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.start_facts import RunningReport
from qinglong_protocol.bounds import encode_lease_capability

from tests.support.postgres import MigratedDatabase
from tests.support.world import PROJECT, ClaimedWork, World

CALLBACK_DIGEST = hashlib.sha256(b"callback token of the flow").hexdigest()
REPORT = RunningReport("pid:4242;start:1700000000", "log-1", 7, parse_digest(CALLBACK_DIGEST))

TEXT_LIKE = ("text", "varchar", "bpchar", "name", "json", "jsonb", "bytea", "_text", "_varchar")


@dataclass(frozen=True)
class Secret:
    capability: str

    @property
    def raw(self) -> bytes:
        part = self.capability.removeprefix("qlc1_")
        return base64.urlsafe_b64decode(part + "=")

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.capability.encode()).hexdigest()

    def needles(self) -> list[str]:
        """The plaintext and the secret in each encoding it could be written in."""
        return [
            self.capability,
            self.capability.removeprefix("qlc1_"),
            base64.b64encode(self.raw).decode().rstrip("="),
            self.raw.hex(),
        ]


def new_secret() -> Secret:
    return Secret(encode_lease_capability(secrets.token_bytes(32)))


class Flow:
    """Runs the commands and keeps every answer and refusal a caller would see."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.secrets: list[Secret] = []
        self.seen: list[object] = []  # answers and refusals, as a caller would get them

    async def call(self, command: Any, refused: Reason | None = None) -> Any:
        if refused is None:
            answer = await command
            self.seen.append(answer)
            return answer
        with pytest.raises(Refused) as error:
            await command
        assert error.value.reason is refused, error.value
        self.seen.append(error.value)
        return None

    async def claimed(self, worker_id: str) -> ClaimedWork:
        work = await self.world.claimed(worker_id)
        self.secrets.append(Secret(work.capability))
        self.seen.append(work.fence)
        return work

    def other(self) -> Secret:
        secret = new_secret()
        self.secrets.append(secret)
        return secret

    def claim_request(self, work: ClaimedWork, secret: Secret) -> ClaimRequest:
        fence = work.fence
        return ClaimRequest(
            fence.worker_id,
            fence.session_id,
            fence.worker_generation,
            fence.offer_id,
            PROJECT,
            fence.run_id,
            digest_of_capability(secret.capability),
        )


async def run_flow(flow: Flow) -> list[ClaimedWork]:
    conn, timings = flow.world.conn, flow.world.timings

    # Claim, exact claim retry, claim with another capability.
    first = await flow.claimed("worker-a")
    own = Secret(first.capability)
    replay = await flow.call(placement.claim_offer(conn, flow.claim_request(first, own), timings))
    assert replay.replayed
    await flow.call(
        placement.claim_offer(conn, flow.claim_request(first, flow.other()), timings),
        Reason.OFFER_CLAIMED_BY_OTHER_CAPABILITY,
    )
    # starting, its replay, a wrong token; running, its replay, a conflicting handle.
    wrong = replace(first.fence, token_digest=digest_of_capability(flow.other().capability))
    await flow.call(acknowledge_starting(conn, wrong), Reason.LEASE_TOKEN_MISMATCH)
    await flow.call(acknowledge_starting(conn, first.fence))
    await flow.call(acknowledge_starting(conn, first.fence))
    await flow.call(acknowledge_running(conn, wrong, REPORT), Reason.LEASE_TOKEN_MISMATCH)
    await flow.call(acknowledge_running(conn, first.fence, REPORT))
    await flow.call(acknowledge_running(conn, first.fence, REPORT))
    await flow.call(
        acknowledge_running(conn, first.fence, replace(REPORT, executor_handle="pid:1")),
        Reason.REPLAY_MISMATCH,
    )
    await flow.call(acknowledge_starting(conn, first.fence))

    # A start failure on another run, its lost-response replay, and a wrong token.
    second = await flow.claimed("worker-b")
    await flow.call(acknowledge_starting(conn, second.fence))
    wrong = replace(second.fence, token_digest=digest_of_capability(flow.other().capability))
    await flow.call(report_start_failure(conn, wrong, "boom"), Reason.LEASE_TOKEN_MISMATCH)
    await flow.call(report_start_failure(conn, second.fence, "exec: no such file"))
    await flow.call(report_start_failure(conn, second.fence, "exec: no such file"))

    # A start failure under a cancellation intent (written as the runtime role: there is
    # no cancel command yet), and a running ACK on the terminal attempt.
    third = await flow.claimed("worker-b")
    await flow.call(acknowledge_starting(conn, third.fence))
    await conn.execute(
        "UPDATE qinglong.runs SET cancel_requested_at_ms = qinglong.db_now_ms(),"
        " cancel_reason = 'user' WHERE run_id = %s",
        (third.fence.run_id,),
    )
    await flow.call(report_start_failure(conn, third.fence, "cancelled while starting"))
    await flow.call(acknowledge_running(conn, third.fence, REPORT), Reason.LEASE_NOT_LEASED)

    # Capabilities refused before any database work: weak and malformed.
    for rejected, reason in (
        ("qlc1_" + "A" * 43, Reason.CAPABILITY_WEAK),
        (first.capability[:-1], Reason.CAPABILITY_MALFORMED),
    ):
        with pytest.raises(Refused) as refused:
            digest_of_capability(rejected)
        assert refused.value.reason is reason
        flow.seen.append(refused.value)
    return [first, second, third]


async def text_columns(admin: psycopg.AsyncConnection[Any]) -> list[tuple[str, str, str]]:
    """(table, column, base type) of every text-like column, domains resolved."""
    cursor = await admin.execute(
        "SELECT c.relname, a.attname, base.typname"
        "  FROM pg_attribute a"
        "  JOIN pg_class c ON c.oid = a.attrelid"
        "  JOIN pg_namespace n ON n.oid = c.relnamespace"
        "  JOIN pg_type t ON t.oid = a.atttypid"
        "  JOIN pg_type base ON base.oid = coalesce(nullif(t.typbasetype, 0), t.oid)"
        " WHERE n.nspname = 'qinglong' AND c.relkind IN ('r', 'p')"
        "   AND a.attnum > 0 AND NOT a.attisdropped AND base.typname = ANY(%s)"
        " ORDER BY 1, 2",
        (list(TEXT_LIKE),),
    )
    return [(table, column, kind) for table, column, kind in await cursor.fetchall()]


async def column_values(
    admin: psycopg.AsyncConnection[Any], table: str, column: str, kind: str
) -> list[str]:
    """Every non-null value as text; bytea also as its raw bytes decoded leniently."""
    query = sql.SQL("SELECT {col}{cast} FROM qinglong.{table} WHERE {col} IS NOT NULL").format(
        col=sql.Identifier(column),
        cast=sql.SQL("" if kind == "bytea" else "::text"),
        table=sql.Identifier(table),
    )
    values: list[str] = []
    for (value,) in await (await admin.execute(query)).fetchall():
        if isinstance(value, bytes):
            values += [value.hex(), value.decode("latin-1")]
        else:
            values.append(value)
    return values


async def test_no_capability_plaintext_in_any_table_event_or_wire_message(
    database: MigratedDatabase, world: World, tmp_path: Path
) -> None:
    flow = Flow(world)
    trace_path = tmp_path / "runtime.trace"
    with trace_path.open("w") as sink:
        world.conn.pgconn.trace(sink.fileno())
        world.conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            works = await run_flow(flow)
        finally:
            world.conn.pgconn.untrace()
    wire = trace_path.read_text(errors="replace")
    needles = [needle for secret in flow.secrets for needle in secret.needles()]
    assert len(flow.secrets) == 6  # three claimed, three presented by someone else
    stored_digests = {Secret(work.capability).digest for work in works}

    # 1. What the runtime sent to PostgreSQL: digests yes, plaintext never.
    assert all(digest in wire for digest in stored_digests), "the trace missed parameters"
    assert not [n for n in needles if n in wire], "a capability was sent to the database"

    async with await psycopg.AsyncConnection.connect(database.urls.migration) as admin:
        # 2. Every text, json/jsonb and bytea column of every table.
        columns = await text_columns(admin)
        assert {
            ("attempts", "lease_token_digest", "text"),
            ("run_leases", "token_digest", "text"),
            ("run_events", "payload", "jsonb"),
            ("runs", "error_summary", "text"),
            ("worker_sessions", "executor_types", "_text"),
        } <= set(columns)
        found_digests: set[str] = set()
        for table, column, kind in columns:
            for value in await column_values(admin, table, column, kind):
                leaked = [needle for needle in needles if needle in value]
                assert not leaked, f"qinglong.{table}.{column} holds a capability"
                found_digests |= {digest for digest in stored_digests if digest in value}
        assert found_digests == stored_digests, "the column scan missed the stored digests"

        # 3. Every whole row of every table, whatever its column types.
        tables = await admin.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'qinglong' ORDER BY 1"
        )
        for (table,) in await tables.fetchall():
            rows = await admin.execute(
                sql.SQL("SELECT t::text FROM qinglong.{} AS t").format(sql.Identifier(table))
            )
            for (row,) in await rows.fetchall():
                assert not [n for n in needles if n in row], f"a row of qinglong.{table}"

    # 4. Event payloads as the read API returns them: no capability, and no digest either.
    secret_digests = {secret.digest for secret in flow.secrets} | {CALLBACK_DIGEST}
    event_count = 0
    for work in works:
        events, _ = await runs.list_events(
            world.conn, PROJECT, work.fence.run_id, after_sequence=0, limit=100
        )
        event_count += len(events)
        for event in events:
            payload = json.dumps(event.payload)
            assert not [n for n in [*needles, *secret_digests] if n in payload], event
    assert event_count >= 16

    # 5. Answers and refusals a caller sees, and the domain objects that could be logged.
    assert any(isinstance(answer, Refused) for answer in flow.seen)
    for answer in flow.seen:
        for text in (repr(answer), str(answer)):
            assert not [n for n in [*needles, *secret_digests] if n in text], text


async def test_fence_repr_hides_the_token_digest(world: World) -> None:
    work = await world.claimed()
    digest = Secret(work.capability).digest
    assert work.fence.token_digest.hex == digest
    for text in (repr(work.fence), str(work.fence), repr(work.fence.token_digest)):
        assert digest not in text
        assert work.capability not in text
    assert "TokenDigest(<redacted>)" in repr(work.fence)
