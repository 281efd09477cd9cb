"""`qinglong run watch` through what a long watch meets in production, with the real
`qinglong` executable and a real stack: a connection cut (an ingress pod restarted in a
rolling deploy: a TCP relay between them ends every connection at once), and streams
that outlive ingress's bound on a call's lifetime. The watch resumes after the last Event
it printed: every Event once, in order, and it ends by itself when the Run is terminal."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import psycopg
import pytest
from qinglong_control.db.pool import PoolSizing, open_runtime_pool
from qinglong_control.reconciler import Reconciler, ReconcilerLimits
from qinglong_ingress import gateway

from tests.support.cli import QINGLONG, qinglong
from tests.support.stack import Stack
from tests.support.tcp_relay import TcpRelay

WATCH_SECONDS = 60.0


def relayed(stack_file: Path, address: str, directory: Path) -> Path:
    """The same operator and stack, reached at another address."""
    document = json.loads(stack_file.read_text())
    document["ingress"]["address"] = address
    path = directory / "relayed.json"
    path.write_text(json.dumps(document))
    return path


async def queued_run(stack_file: Path) -> str:
    created = await qinglong(
        "task", "create", "--stack", str(stack_file), "--name", "w", "--", "true"
    )
    task_id = json.loads(created.out)["taskId"]
    triggered = await qinglong("run", "trigger", "--task", task_id, "--stack", str(stack_file))
    return str(json.loads(triggered.out)["runId"])


async def watching(
    run_id: str, stack_path: Path, *flags: str
) -> tuple[asyncio.subprocess.Process, bytes]:
    """`run watch` started, once it printed the Run's first Event (its stream is live)."""
    watch = await asyncio.create_subprocess_exec(
        str(QINGLONG), "run", "watch", run_id, "--stack", str(stack_path), *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert watch.stdout is not None
    first = await asyncio.wait_for(watch.stdout.readline(), WATCH_SECONDS)
    assert json.loads(first)["type"] == "run.queued"
    return watch, first


async def cancelled(stack: Stack, stack_file: Path, run_id: str) -> None:
    """The queued Run cancelled, and made terminal by a reconcile cycle."""
    answered = await qinglong("run", "cancel", run_id, "--stack", str(stack_file))
    assert answered.code == 0, answered.err
    async with await open_runtime_pool(
        stack.database.urls.runtime, sizing=PoolSizing(1, 2)
    ) as pool:
        await Reconciler(pool, ReconcilerLimits()).cycle()


def events_of(printed: bytes) -> list[dict[str, object]]:
    events = [json.loads(line) for line in printed.decode().splitlines()]
    assert [event["sequence"] for event in events] == list(range(1, len(events) + 1))
    assert events[-1]["type"] == "run.cancelled", events
    return events


async def test_run_watch_resumes_after_its_connection_is_cut(
    stack: Stack, stack_file: Path, tmp_path: Path
) -> None:
    run_id = await queued_run(stack_file)
    async with TcpRelay(stack.ingress_address) as relay:
        watch, first = await watching(run_id, relayed(stack_file, relay.address, tmp_path))
        assert relay.cut() >= 2, "the watch's connection went through the relay"
        # Events committed while the watch is cut off are streamed once it resumes.
        await cancelled(stack, stack_file, run_id)
        rest, err = await asyncio.wait_for(watch.communicate(), WATCH_SECONDS)
    events = events_of(first + rest)  # each sequence number once, 1..n: none lost or twice
    print(f"connection cut once: {len(events)} Events streamed, lost 0, duplicated 0")
    assert watch.returncode == 0, err.decode()
    assert "[the event stream broke (UNAVAILABLE); resuming after event 1]" in err.decode()
    assert relay.connections >= 2


async def test_run_watch_outlives_the_lifetime_of_a_stream(
    stack: Stack, stack_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ingress ends any stream after its bound (30 s; 1.5 s here): the watch opens the
    next one after the last Event, quietly, for as long as the Run takes."""
    monkeypatch.setattr(gateway, "STREAM_LIFETIME_SECONDS", 1.5)
    run_id = await queued_run(stack_file)
    watch, first = await watching(run_id, stack_file)
    await asyncio.sleep(5.0)  # three streams' lifetimes with nothing to say
    assert watch.returncode is None, "the watch ended with its first stream"
    # Each stream is a call ingress audited: the watch really opened the next ones.
    assert watch_streams(stack, run_id) >= 3
    await cancelled(stack, stack_file, run_id)
    rest, err = await asyncio.wait_for(watch.communicate(), WATCH_SECONDS)
    events_of(first + rest)
    assert (watch.returncode, err.decode()) == (0, "")


def watch_streams(stack: Stack, run_id: str) -> int:
    with psycopg.connect(stack.database.urls.migration) as conn:
        row = conn.execute(
            "SELECT count(*) FROM qinglong.security_audit"
            " WHERE run_id = %s AND operation LIKE %s AND outcome = 'admitted'",
            (run_id, "%/WatchRunEvents"),
        ).fetchone()
    assert row is not None
    return int(row[0])


async def test_run_watch_exit_status_says_the_run_did_not_succeed(
    stack: Stack, stack_file: Path
) -> None:
    """Scripts wait on a Run with `run watch --exit-status`: 0 only if it succeeded."""
    run_id = await queued_run(stack_file)
    watch, first = await watching(run_id, stack_file, "--exit-status")
    await cancelled(stack, stack_file, run_id)
    rest, err = await asyncio.wait_for(watch.communicate(), WATCH_SECONDS)
    events_of(first + rest)
    assert (watch.returncode, err.decode()) == (4, "the run ended cancelled\n")


async def test_a_reader_that_goes_away_ends_the_command_without_a_traceback(
    stack: Stack, stack_file: Path
) -> None:
    """`qinglong run list | head -1`: the pipe closes before everything is printed."""
    for _ in range(3):
        await queued_run(stack_file)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    try:
        listing = await asyncio.create_subprocess_exec(
            str(QINGLONG), "run", "list", "--stack", str(stack_file), "--output", "table",
            stdout=write_end, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        os.close(write_end)
    _, err = await asyncio.wait_for(listing.communicate(), WATCH_SECONDS)
    assert (listing.returncode, err.decode()) == (128 + signal.SIGPIPE, "")
