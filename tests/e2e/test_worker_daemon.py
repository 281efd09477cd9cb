"""`qinglong-worker run` as a real process against `qinglong up`: a Run goes to `succeeded`,
a user cancel stops the running executor and ends the Run `cancelled`, and a restarted
Worker resumes its session from the durable inbox and stops an executor it did not spawn.
Both the stack and the Worker stop cleanly on SIGINT; no secret reaches the Worker's log."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from qinglong.control.v1 import (
    run_service_pb2,
    run_service_pb2_grpc,
    task_service_pb2,
    task_service_pb2_grpc,
)
from qinglong.rpc.v1 import execution_pb2, lifecycle_pb2
from qinglong_protocol.tls import TlsFiles, mutual_tls_channel_credentials

QINGLONG = Path(sys.executable).with_name("qinglong")
QINGLONG_WORKER = Path(sys.executable).with_name("qinglong-worker")
START_TIMEOUT_SECONDS = 120.0
RUN_TIMEOUT_SECONDS = 30.0
STOP_TIMEOUT_SECONDS = 30.0
RUN_STATE = lifecycle_pb2.RunState


@dataclass
class DevStack:
    process: subprocess.Popen[str]
    path: Path
    document: dict[str, Any]


@dataclass
class Operator:
    tasks: task_service_pb2_grpc.TaskServiceStub
    runs: run_service_pb2_grpc.RunServiceStub
    metadata: tuple[tuple[str, str], ...]
    project_id: str

    def trigger(self, command: list[str], timeout_ms: int = 60_000) -> str:
        task = self.tasks.CreateTask(
            task_service_pb2.CreateTaskRequest(
                project_id=self.project_id, request_id=uuid.uuid4().hex, display_name="e2e"
            ),
            metadata=self.metadata,
            timeout=10,
        )
        self.tasks.CreateTaskRevision(
            task_service_pb2.CreateTaskRevisionRequest(
                project_id=self.project_id,
                task_id=task.task.task_id,
                request_id="rev-1",
                plan=execution_pb2.ExecutionPlan(
                    executor_type=execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER,
                    command=command,
                    timeout_ms=timeout_ms,
                ),
            ),
            metadata=self.metadata,
            timeout=10,
        )
        run = self.runs.TriggerRun(
            run_service_pb2.TriggerRunRequest(
                project_id=self.project_id,
                task_id=task.task.task_id,
                request_id=uuid.uuid4().hex,
            ),
            metadata=self.metadata,
            timeout=10,
        )
        return str(run.run.run_id)

    def run(self, run_id: str) -> Any:
        return self.runs.GetRun(
            run_service_pb2.GetRunRequest(project_id=self.project_id, run_id=run_id),
            metadata=self.metadata,
            timeout=10,
        ).run

    def wait_for(self, run_id: str, state: int, seconds: float = RUN_TIMEOUT_SECONDS) -> Any:
        deadline = time.monotonic() + seconds
        run = self.run(run_id)
        while run.state != state:
            if time.monotonic() > deadline:
                pytest.fail(f"run is {RUN_STATE.Name(run.state)}, not {RUN_STATE.Name(state)}")
            time.sleep(0.1)
            run = self.run(run_id)
        return run

    def cancel(self, run_id: str) -> Any:
        return self.runs.CancelRun(
            run_service_pb2.CancelRunRequest(
                project_id=self.project_id, run_id=run_id, mutation_id=uuid.uuid4().hex[:16]
            ),
            metadata=self.metadata,
            timeout=10,
        )

    def event_types(self, run_id: str) -> list[str]:
        events = self.runs.ListRunEvents(
            run_service_pb2.ListRunEventsRequest(project_id=self.project_id, run_id=run_id),
            metadata=self.metadata,
            timeout=10,
        ).events
        return [event.type for event in events]


@pytest.fixture(scope="module")
def dev_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    data_dir = tmp_path_factory.mktemp("worker-e2e") / "stack"
    stack_path = data_dir / "stack.json"
    process = subprocess.Popen(
        [str(QINGLONG), "up", "--data-dir", str(data_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not stack_path.exists():
            if process.poll() is not None:
                out, err = process.communicate()
                pytest.fail(f"qinglong up exited with {process.returncode}:\n{out}\n{err}")
            if time.monotonic() > deadline:
                pytest.fail("qinglong up wrote no stack.json in time")
            time.sleep(0.1)
        document = json.loads(stack_path.read_text())
    except BaseException:
        process.kill()
        process.communicate()
        raise
    yield DevStack(process, stack_path, document)
    process.send_signal(signal.SIGINT)
    try:
        out, err = process.communicate(timeout=STOP_TIMEOUT_SECONDS * 2)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert process.returncode == 0, out + err


@pytest.fixture(scope="module")
def operator(dev_stack: DevStack) -> Iterator[Operator]:
    stack = dev_stack.document
    tls = TlsFiles(
        ca_cert=Path(stack["ca_cert"]),
        cert=Path(stack["operator"]["cert"]),
        key=Path(stack["operator"]["key"]),
    )
    token = Path(stack["operator"]["token_file"]).read_text().strip()
    with grpc.secure_channel(
        stack["ingress"]["address"], mutual_tls_channel_credentials(tls)
    ) as channel:
        yield Operator(
            task_service_pb2_grpc.TaskServiceStub(channel),
            run_service_pb2_grpc.RunServiceStub(channel),
            (("authorization", f"Bearer {token}"),),
            stack["project_id"],
        )


class Worker:
    """One `qinglong-worker run` process; its log goes to a file (never a pipe that could
    fill up), appended to across restarts."""

    def __init__(self, stack_path: Path, inbox: Path) -> None:
        self.inbox = inbox
        self.log = inbox.with_name("worker.log")
        inbox.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as log:
            self.process = subprocess.Popen(
                [
                    str(QINGLONG_WORKER),
                    "run",
                    "--stack",
                    str(stack_path),
                    "--inbox",
                    str(inbox),
                    "--tick-seconds",
                    "0.2",
                    "--lease-control-seconds",
                    "1",
                    "--max-concurrency",
                    "2",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )

    def stop(self) -> int:
        """SIGINT and wait; the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise

    def record(self, run_id: str) -> dict[str, Any]:
        """The inbox row of a Run, read the way any other reader would (WAL, read-only)."""
        with sqlite3.connect(f"file:{self.inbox}?mode=ro", uri=True) as db:
            db.row_factory = sqlite3.Row
            row = db.execute("SELECT * FROM offers WHERE run_id = ?", (run_id,)).fetchone()
        assert row is not None, "the Run is not in the inbox"
        return dict(row)

    def wait_for_record(self, run_id: str, state: str) -> dict[str, Any]:
        deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
        record = self.record(run_id)
        while record["state"] != state:
            if time.monotonic() > deadline:
                pytest.fail(f"the inbox record is {record['state']}, not {state}")
            time.sleep(0.05)
            record = self.record(run_id)
        return record

    def assert_log_holds_no_secret(self) -> None:
        text = self.log.read_text()
        with sqlite3.connect(f"file:{self.inbox}?mode=ro", uri=True) as db:
            rows = db.execute("SELECT capability, callback_token FROM offers").fetchall()
        assert rows
        for capability, callback_token in rows:
            assert capability not in text
            if callback_token is not None:
                assert callback_token not in text
                assert hashlib.sha256(callback_token.encode()).hexdigest() not in text


def _start_ticks(pid: int) -> int | None:
    """The start time of whatever runs at `pid` now; None if nothing (or a zombie) does."""
    try:
        after = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return None if after[0] in ("Z", "X") else int(after[22 - 3])


def _executor_alive(record: dict[str, Any]) -> bool:
    return _start_ticks(record["executor_pid"]) == record["executor_start_ticks"]


def test_worker_runs_a_run_to_succeeded(
    dev_stack: DevStack, operator: Operator, tmp_path: Path
) -> None:
    run_id = operator.trigger(["sh", "-c", "echo hi"])
    worker = Worker(dev_stack.path, tmp_path / "worker" / "inbox.db")
    try:
        run = operator.wait_for(run_id, RUN_STATE.RUN_STATE_SUCCEEDED)
        record = worker.wait_for_record(run_id, "completion_acknowledged")
    finally:
        assert worker.stop() == 0, worker.log.read_text()
    assert run.attempt_count == 1
    assert run.error_code == ""
    assert operator.event_types(run_id) == [
        "run.queued",
        "attempt.claimed",
        "run.dispatching",
        "attempt.starting",
        "attempt.running",
        "run.running",
        "attempt.succeeded",
        "run.succeeded",
    ]
    assert (record["exit_code"], record["completion_outcome"]) == (0, "succeeded")
    assert record["lease_version"] >= 2  # completion answered expected + 1
    assert (tmp_path / "worker" / "logs" / f"{record['offer_id']}.log").read_text() == "hi\n"
    assert worker.inbox.stat().st_mode & 0o077 == 0
    worker.assert_log_holds_no_secret()


def test_user_cancel_stops_the_running_process(
    dev_stack: DevStack, operator: Operator, tmp_path: Path
) -> None:
    run_id = operator.trigger(["sleep", "30"], timeout_ms=60_000)
    worker = Worker(dev_stack.path, tmp_path / "worker" / "inbox.db")
    try:
        operator.wait_for(run_id, RUN_STATE.RUN_STATE_RUNNING)
        # `running` commits before the Worker persists the answer; wait for the inbox too.
        record = worker.wait_for_record(run_id, "running_acknowledged")
        assert _executor_alive(record)
        # R-TO-2: the executor got timeout and the durable deadline; never the capability.
        environ = Path(f"/proc/{record['executor_pid']}/environ").read_bytes().split(b"\0")
        assert b"QINGLONG_TIMEOUT_MS=60000" in environ
        deadline = [v for v in environ if v.startswith(b"QINGLONG_DEADLINE_UNIX_MS=")]
        assert len(deadline) == 1
        assert record["capability"].encode() not in b"\0".join(environ)

        accepted = operator.cancel(run_id)
        assert accepted.outcome == run_service_pb2.CANCEL_RUN_OUTCOME_ACCEPTED
        run = operator.wait_for(run_id, RUN_STATE.RUN_STATE_CANCELLED)
        stopped = worker.wait_for_record(run_id, "completion_acknowledged")
    finally:
        assert worker.stop() == 0, worker.log.read_text()
    assert run.error_code == "EXECUTION_CANCELLED"
    assert not _executor_alive(record), "the executor was stopped"
    assert (stopped["stop_reason"], stopped["exit_signal"]) == ("user", signal.SIGTERM)
    assert operator.event_types(run_id)[-3:] == [
        "run.cancel_requested",
        "attempt.cancelled",
        "run.cancelled",
    ]
    worker.assert_log_holds_no_secret()


def test_a_restarted_worker_resumes_and_stops_its_executor_on_cancel(
    dev_stack: DevStack, operator: Operator, tmp_path: Path
) -> None:
    inbox = tmp_path / "worker" / "inbox.db"
    run_id = operator.trigger(["sleep", "30"], timeout_ms=60_000)
    first = Worker(dev_stack.path, inbox)
    try:
        operator.wait_for(run_id, RUN_STATE.RUN_STATE_RUNNING)
        record = first.wait_for_record(run_id, "running_acknowledged")
    finally:
        assert first.stop() == 0, first.log.read_text()
    # The daemon's exit leaves the executor running: it is owned by the durable inbox.
    assert _executor_alive(record)

    second = Worker(dev_stack.path, inbox)
    try:
        operator.cancel(run_id)
        run = operator.wait_for(run_id, RUN_STATE.RUN_STATE_CANCELLED)
        stopped = second.wait_for_record(run_id, "completion_acknowledged")
    finally:
        assert second.stop() == 0, second.log.read_text()
    assert run.attempt_count == 1
    assert not _executor_alive(record), "the restarted Worker stopped it by its identity"
    log = second.log.read_text()
    assert "resumed" in log, "the session was resumed, not replaced"
    assert stopped["completion_outcome"] == "cancelled"
    # Not the daemon's child any more: its exit status could not be observed.
    assert stopped["exit_code"] is None
    assert stopped["exit_signal"] is None
    second.assert_log_holds_no_secret()
    assert os.stat(inbox).st_mode & 0o077 == 0
