"""`qinglong-worker run` as a real process against `qinglong up`: a Run goes to `succeeded`,
a user cancel stops the running executor and ends the Run `cancelled`, and a restarted
Worker resumes its session from the durable inbox and stops an executor it did not spawn.
Both the stack and the Worker stop cleanly on SIGINT; no secret reaches the Worker's log.

Issue 7 ("Nothing lost"): `kill -9` of the Worker while its executor runs keeps the
executor's real exit status (its supervisor records it), so the restarted Worker reports
`succeeded` or `failed` with the real exit code; a corrupt inbox is one clear error at
start, and while running it stops the executor and exits non-zero; SIGTERM drains —
a short job finishes, a long one is stopped when the grace runs out and its Run ends
`cancelled` for `shutdown`, a second signal stops at once."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
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

from tests.support import timelines
from tests.support.devstack_process import admin_cli
from tests.support.polling import wait_until
from tests.support.run_output import run_logs

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

    def trigger(
        self,
        command: list[str],
        timeout_ms: int = 60_000,
        parameters: dict[str, str] | None = None,
        worker_selector: dict[str, str] | None = None,
        queue_timeout_ms: int | None = None,
    ) -> str:
        task_id = self.task(
            command, timeout_ms, worker_selector=worker_selector, queue_timeout_ms=queue_timeout_ms
        )
        return self.trigger_task(task_id, parameters)

    def task(
        self,
        command: list[str],
        timeout_ms: int = 60_000,
        *,
        worker_selector: dict[str, str] | None = None,
        queue_timeout_ms: int | None = None,
        max_concurrent_runs: int | None = None,
    ) -> str:
        """A new task with one revision of this plan; its id."""
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
                    worker_selector=worker_selector,
                    queue_timeout_ms=queue_timeout_ms,
                    max_concurrent_runs=max_concurrent_runs,
                ),
            ),
            metadata=self.metadata,
            timeout=10,
        )
        return str(task.task.task_id)

    def trigger_task(self, task_id: str, parameters: dict[str, str] | None = None) -> str:
        """A new Run of the task's newest revision; its id."""
        run = self.runs.TriggerRun(
            run_service_pb2.TriggerRunRequest(
                project_id=self.project_id,
                task_id=task_id,
                request_id=uuid.uuid4().hex,
                parameters=parameters,
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

    def events(self, run_id: str) -> list[Any]:
        return list(
            self.runs.ListRunEvents(
                run_service_pb2.ListRunEventsRequest(project_id=self.project_id, run_id=run_id),
                metadata=self.metadata,
                timeout=10,
            ).events
        )

    def event_types(self, run_id: str) -> list[str]:
        return [event.type for event in self.events(run_id)]

    def finished_exit_codes(self, run_id: str) -> list[int | None]:
        """The exit code of each attempt.* terminal Event (None when none was reported)."""
        return [
            event.attempt_finished.exit_code
            if event.attempt_finished.HasField("exit_code")
            else None
            for event in self.events(run_id)
            if event.HasField("attempt_finished")
        ]


@pytest.fixture(scope="module")
def dev_stack() -> Iterator[DevStack]:
    # Not under pytest's basetemp: another pytest session on the machine may prune it
    # while this module's cluster still runs.
    root = Path(tempfile.mkdtemp(prefix="qinglong-worker-e2e-"))
    try:
        yield from _dev_stack(root / "stack")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _dev_stack(data_dir: Path) -> Iterator[DevStack]:
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

    def __init__(self, stack_path: Path, inbox: Path, *extra_flags: str) -> None:
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
                    "--stop-grace-seconds",
                    "2",
                    *extra_flags,
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

    def kill9(self) -> None:
        self.process.kill()
        self.process.wait()

    def wait(self, seconds: float = STOP_TIMEOUT_SECONDS) -> int:
        try:
            return self.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.kill9()
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
    assert operator.event_types(run_id) == list(timelines.SUCCEEDED)
    assert (record["exit_code"], record["completion_outcome"]) == (0, "succeeded")
    assert record["lease_version"] >= 2  # completion answered expected + 1
    assert (tmp_path / "worker" / "logs" / f"{record['offer_id']}.log").read_text() == "hi\n"
    output = operator.runs.ReadRunOutput(
        run_service_pb2.ReadRunOutputRequest(project_id=operator.project_id, run_id=run_id),
        metadata=operator.metadata,
        timeout=10,
    )
    # The Worker said how much it captured when it reported the ending: all of it is held.
    assert (output.data, output.complete, output.output_bytes) == (b"hi\n", True, 3)
    # `run logs` prints the output as it is, whatever --output says (no `[]` after it).
    for output_format in ("json", "table", "jsonl"):
        printed, error = run_logs(dev_stack.path, run_id, "--output", output_format).communicate(
            timeout=60
        )
        assert (printed, error) == (b"hi\n", b""), output_format
    assert worker.inbox.stat().st_mode & 0o077 == 0
    worker.assert_log_holds_no_secret()


def test_a_runs_parameters_reach_its_executor_as_environment_variables(
    dev_stack: DevStack, operator: Operator, tmp_path: Path
) -> None:
    """TriggerRun's parameters travel with the offer and the claim to the Worker, which
    hands each to the executor as QINGLONG_PARAM_<name>, the value byte for byte; the
    Worker's own QINGLONG_* settings never reach it."""
    parameters = {"GREETING": "h\u00e9llo = 'world' \u6625", "EMPTY": "", "N_2": "$HOME"}
    script = (
        'printf "%s|%s|%s|" "$QINGLONG_PARAM_GREETING" "$QINGLONG_PARAM_EMPTY"'
        ' "$QINGLONG_PARAM_N_2"; env | grep -c "^QINGLONG_PARAM_"'
    )
    run_id = operator.trigger(["sh", "-c", script], parameters=parameters)
    worker = Worker(dev_stack.path, tmp_path / "worker" / "inbox.db")
    try:
        run = operator.wait_for(run_id, RUN_STATE.RUN_STATE_SUCCEEDED)
    finally:
        assert worker.stop() == 0, worker.log.read_text()
    assert dict(run.parameters) == parameters
    output = operator.runs.ReadRunOutput(
        run_service_pb2.ReadRunOutputRequest(project_id=operator.project_id, run_id=run_id),
        metadata=operator.metadata,
        timeout=10,
    )
    expected = f"{parameters['GREETING']}||$HOME|3\n"
    assert output.data.decode() == expected


def test_a_run_that_needs_labels_waits_for_a_worker_that_declares_them(
    dev_stack: DevStack, operator: Operator, tmp_path: Path
) -> None:
    """A Run whose revision selects gpu=a100 is not offered to the daemon while it
    declares no labels (a plain Run queued after it runs meanwhile); the daemon restarted
    with --label gpu=a100 resumes its session, its renewal declares the label, and the
    Run runs."""
    inbox = tmp_path / "worker" / "inbox.db"
    needs_gpu = operator.trigger(["echo", "on a gpu"], worker_selector={"gpu": "a100"})
    plain = operator.trigger(["echo", "anywhere"])
    worker = Worker(dev_stack.path, inbox)
    try:
        operator.wait_for(plain, RUN_STATE.RUN_STATE_SUCCEEDED)
        time.sleep(2)  # ten more pulls, at least
        assert operator.run(needs_gpu).state == RUN_STATE.RUN_STATE_QUEUED
    finally:
        assert worker.stop() == 0, worker.log.read_text()
    labelled = Worker(dev_stack.path, inbox, "--label", "gpu=a100", "--label", "zone=eu")
    try:
        operator.wait_for(needs_gpu, RUN_STATE.RUN_STATE_SUCCEEDED)
    finally:
        assert labelled.stop() == 0, labelled.log.read_text()
    log = worker.log.read_text()
    assert "resumed" in log  # the same session, relabelled
    assert "labels none)" in log
    assert "labels gpu=a100,zone=eu)" in log


def test_a_worker_refuses_to_start_with_a_label_the_contract_refuses(tmp_path: Path) -> None:
    """A label ingress would refuse would fail every OpenSession: the daemon says which
    and exits before it connects."""
    result = subprocess.run(
        [
            str(QINGLONG_WORKER),
            "run",
            "--worker-id",
            "w",
            "--ingress-address",
            "127.0.0.1:1",
            "--tls-ca",
            "ca",
            "--tls-cert",
            "cert",
            "--tls-key",
            "key",
            "--inbox",
            str(tmp_path / "inbox.db"),
            "--label",
            "GPU=a100",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result
    assert "label key 'GPU' must be" in result.stderr
    assert not (tmp_path / "inbox.db").exists()


def _probe(inbox: Path, stale_seconds: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(QINGLONG_WORKER),
            "probe",
            "--inbox",
            str(inbox),
            "--stale-seconds",
            str(stale_seconds),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_liveness_probe_fails_while_the_daemon_is_stopped_and_passes_again(
    dev_stack: DevStack, tmp_path: Path
) -> None:
    """A daemon whose loop stops (SIGSTOP stands in for a call that never returns) fails
    its probe once the heartbeat is older than the limit, and passes again once it ticks."""
    inbox = tmp_path / "worker" / "inbox.db"
    before = _probe(inbox, 2)
    assert (before.returncode, before.stdout.startswith("no heartbeat")) == (1, True), before
    worker = Worker(dev_stack.path, inbox)
    try:
        assert wait_until(lambda: _probe(inbox, 2).returncode == 0, 60), worker.log.read_text()
        worker.process.send_signal(signal.SIGSTOP)
        try:
            # The probe's own start takes a while on a loaded machine: wait for a verdict.
            assert wait_until(lambda: _probe(inbox, 2).returncode == 1, 60)
            stale = _probe(inbox, 2)
            assert stale.stdout.startswith("stale: the Worker last ticked"), stale
            # A generous limit still takes the same heartbeat as alive.
            assert _probe(inbox, 3600).returncode == 0
        finally:
            worker.process.send_signal(signal.SIGCONT)
        assert wait_until(lambda: _probe(inbox, 2).returncode == 0, 60), worker.log.read_text()
    finally:
        assert worker.stop() == 0, worker.log.read_text()


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
        # The recorded identity is the executor's supervisor; the executor is its child.
        (executor,) = _supervised(record)
        # R-TO-2: the executor got timeout and the durable deadline; never the capability.
        environ = Path(f"/proc/{executor}/environ").read_bytes().split(b"\0")
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
    assert not _alive(executor)
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
        first.kill9()
    # A crashed daemon leaves the executor running: it is owned by the durable inbox.
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
    # Not the daemon's child any more, yet its supervisor recorded how it ended.
    assert (stopped["exit_code"], stopped["exit_signal"]) == (None, signal.SIGTERM)
    second.assert_log_holds_no_secret()
    assert os.stat(inbox).st_mode & 0o077 == 0


# --- issue 7: nothing lost --------------------------------------------------------------------


def _supervised(record: dict[str, Any], seconds: float = 5.0) -> list[int]:
    """The processes the recorded identity (the executor's supervisor) runs: the executor."""
    pid = record["executor_pid"]
    deadline = time.monotonic() + seconds
    while True:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except FileNotFoundError:
            children = []
        if children or time.monotonic() > deadline:
            return [int(child) for child in children]
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    return _start_ticks(pid) is not None


def _wait_until_gone(record: dict[str, Any], seconds: float = RUN_TIMEOUT_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while _executor_alive(record):
        if time.monotonic() > deadline:
            pytest.fail("the executor did not end")
        time.sleep(0.05)


def _garble(inbox: Path) -> None:
    """Overwrite the inbox (and its WAL and index) in place with garbage."""
    for path in (inbox, Path(f"{inbox}-wal"), Path(f"{inbox}-shm")):
        if path.exists():
            size = max(path.stat().st_size, 4096)
            with path.open("r+b") as stream:
                stream.write(b"garbage!" * (size // 8))


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if " ERROR " in line]


@pytest.mark.parametrize(
    ("exit_code", "ends_while_down"),
    [(0, True), (3, False)],
    ids=["exit-0-while-no-worker-runs", "exit-3-under-the-restarted-worker"],
)
def test_kill_9_of_the_worker_keeps_the_executors_real_exit_status(
    dev_stack: DevStack,
    operator: Operator,
    tmp_path: Path,
    exit_code: int,
    ends_while_down: bool,
) -> None:
    inbox = tmp_path / "worker" / "inbox.db"
    run_id = operator.trigger(["sh", "-c", f"sleep 3; exit {exit_code}"])
    first = Worker(dev_stack.path, inbox)
    try:
        operator.wait_for(run_id, RUN_STATE.RUN_STATE_RUNNING)
        record = first.wait_for_record(run_id, "running_acknowledged")
    finally:
        first.kill9()
    assert _executor_alive(record), "the executor outlived its Worker"
    if ends_while_down:
        _wait_until_gone(record)

    second = Worker(dev_stack.path, inbox)
    try:
        expected = RUN_STATE.RUN_STATE_SUCCEEDED if exit_code == 0 else RUN_STATE.RUN_STATE_FAILED
        run = operator.wait_for(run_id, expected)
        done = second.wait_for_record(run_id, "completion_acknowledged")
    finally:
        assert second.stop() == 0, second.log.read_text()
    assert run.attempt_count == 1, "no duplicate Attempt"
    assert (done["exit_code"], done["exit_signal"]) == (exit_code, None)
    assert operator.finished_exit_codes(run_id) == [exit_code]
    ending = "succeeded" if exit_code == 0 else "failed"
    assert operator.event_types(run_id) == [
        "run.queued",
        "attempt.claimed",
        "run.dispatching",
        "attempt.starting",
        "attempt.running",
        "run.running",
        f"attempt.{ending}",
        f"run.{ending}",
    ]
    assert "not observable" not in second.log.read_text()
    second.assert_log_holds_no_secret()


def test_a_corrupt_inbox_at_start_is_one_clear_error(dev_stack: DevStack, tmp_path: Path) -> None:
    inbox = tmp_path / "worker" / "inbox.db"
    inbox.parent.mkdir(parents=True)
    inbox.write_bytes(b"garbage!" * 1024)
    result = subprocess.run(
        [str(QINGLONG_WORKER), "run", "--stack", str(dev_stack.path), "--inbox", str(inbox)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = _error_lines(result.stderr)
    assert len(errors) == 1, result.stderr
    assert errors[0].endswith(f"inbox {inbox} is unreadable: file is not a database")


def test_an_inbox_corrupted_while_running_stops_the_executor_and_the_worker(
    dev_stack: DevStack, operator: Operator, tmp_path: Path
) -> None:
    inbox = tmp_path / "worker" / "inbox.db"
    run_id = operator.trigger(["sleep", "60"])
    worker = Worker(dev_stack.path, inbox)
    try:
        operator.wait_for(run_id, RUN_STATE.RUN_STATE_RUNNING)
        record = worker.wait_for_record(run_id, "running_acknowledged")
        executors = _supervised(record)
        assert executors
        _garble(inbox)
        status = worker.wait(30)
    finally:
        if worker.process.poll() is None:
            worker.kill9()
        operator.cancel(run_id)  # nobody reports it now; control converges it
    assert status == 3
    log = worker.log.read_text()
    assert "Traceback" not in log
    assert "tick failed" not in log
    errors = _error_lines(log)
    assert len(errors) == 1, log
    assert f"inbox {inbox} is unreadable" in errors[0]
    assert "stopped 1 executor(s)" in errors[0]
    assert not _executor_alive(record), "the supervisor is gone"
    assert not any(_alive(pid) for pid in executors), "no executor runs without a lease"


def test_sigterm_lets_a_short_job_finish_and_exits_0(
    dev_stack: DevStack, operator: Operator, tmp_path: Path
) -> None:
    run_id = operator.trigger(["sh", "-c", "sleep 2; exit 0"])
    worker = Worker(dev_stack.path, tmp_path / "worker" / "inbox.db", "--drain-grace-seconds", "20")
    try:
        operator.wait_for(run_id, RUN_STATE.RUN_STATE_RUNNING)
        worker.wait_for_record(run_id, "running_acknowledged")
        signalled = time.monotonic()
        worker.process.send_signal(signal.SIGTERM)
        status = worker.wait(30)
    finally:
        if worker.process.poll() is None:
            worker.kill9()
    assert status == 0, worker.log.read_text()
    assert time.monotonic() - signalled < 15, "it left when the job was done, not at the grace"
    run = operator.run(run_id)
    assert run.state == RUN_STATE.RUN_STATE_SUCCEEDED
    record = worker.record(run_id)
    assert (record["state"], record["exit_code"]) == ("completion_acknowledged", 0)
    log = worker.log.read_text()
    assert "draining" in log
    worker.assert_log_holds_no_secret()


@pytest.mark.parametrize("second_signal", [False, True], ids=["grace-runs-out", "second-signal"])
def test_sigterm_stops_a_long_job_and_its_run_ends_cancelled_for_shutdown(
    dev_stack: DevStack, operator: Operator, tmp_path: Path, second_signal: bool
) -> None:
    grace = "60" if second_signal else "1"
    run_id = operator.trigger(["sleep", "60"])
    worker = Worker(
        dev_stack.path, tmp_path / "worker" / "inbox.db", "--drain-grace-seconds", grace
    )
    try:
        operator.wait_for(run_id, RUN_STATE.RUN_STATE_RUNNING)
        record = worker.wait_for_record(run_id, "running_acknowledged")
        executors = _supervised(record)
        worker.process.send_signal(signal.SIGTERM)
        if second_signal:
            time.sleep(1.0)
            assert worker.process.poll() is None, "the first signal only drains"
            assert _executor_alive(record)
            worker.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        status = worker.wait(30)
    finally:
        if worker.process.poll() is None:
            worker.kill9()
    assert status == 0, worker.log.read_text()
    assert time.monotonic() - signalled < 15
    assert not _executor_alive(record)
    assert not any(_alive(pid) for pid in executors), "nothing is left running"
    stopped = worker.record(run_id)
    assert (stopped["stop_reason"], stopped["exit_signal"]) == ("local_shutdown", signal.SIGTERM)
    # Needs control's side of issue 7: CANCELLED + stop_reason SHUTDOWN is accepted.
    run = operator.wait_for(run_id, RUN_STATE.RUN_STATE_CANCELLED, seconds=10)
    assert run.cancel_intent.reason == lifecycle_pb2.CANCEL_REASON_SHUTDOWN
    assert stopped["state"] == "completion_acknowledged", worker.log.read_text()
    assert operator.event_types(run_id)[-2:] == ["attempt.cancelled", "run.cancelled"]


def test_a_signal_while_the_worker_starts_is_an_orderly_shutdown(
    dev_stack: DevStack, tmp_path: Path
) -> None:
    """SIGTERM while the daemon still imports and opens its inbox: exit 0, no traceback
    (it drains an empty Worker)."""
    worker = Worker(dev_stack.path, tmp_path / "worker" / "inbox.db")
    # As soon as the daemon catches SIGTERM (before that the default action would end it,
    # which is no daemon's doing): on a loaded machine that can take well over 0.1 s.
    assert wait_until(lambda: _catches(worker.process.pid, signal.SIGTERM), 30, interval=0.005)
    assert worker.process.poll() is None
    worker.process.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0, worker.log.read_text()
    log = worker.log.read_text()
    assert "Traceback" not in log
    assert "SIGTERM received: drain" in log


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


def test_a_run_nobody_takes_ends_when_its_queue_timeout_passes(
    dev_stack: DevStack, operator: Operator, tmp_path: Path
) -> None:
    """A Run whose selector no Worker satisfies, with a queue timeout of 1.5 s, is ended
    by the stack's reconcile cadence TIMED_OUT / QUEUE_TIMED_OUT, while the daemon (no
    labels) goes on taking the work it may."""
    worker = Worker(dev_stack.path, tmp_path / "worker" / "inbox.db")
    try:
        nobody = operator.trigger(
            ["echo", "never"], worker_selector={"gpu": "none-here"}, queue_timeout_ms=1_500
        )
        plain = operator.trigger(["echo", "anywhere"])
        operator.wait_for(plain, RUN_STATE.RUN_STATE_SUCCEEDED)
        ended = operator.wait_for(nobody, RUN_STATE.RUN_STATE_TIMED_OUT)
    finally:
        assert worker.stop() == 0, worker.log.read_text()
    assert (ended.error_code, ended.attempt_count) == ("QUEUE_TIMED_OUT", 0)
    waited = ended.finished_at.ToMilliseconds() - ended.created_at.ToMilliseconds()
    assert waited >= 1_500


def test_a_cordoned_worker_finishes_its_run_and_takes_no_new_one(
    dev_stack: DevStack, operator: Operator, tmp_path: Path
) -> None:
    """Maintenance: the daemon is cordoned while a Run runs on it; that Run goes on to
    succeed, a Run triggered meanwhile stays queued, the fleet shows its load fall to 0,
    and once uncordoned the waiting Run runs on the same daemon, its session unchanged."""
    worker_id = dev_stack.document["worker"]["worker_id"]
    # Earlier tests of this module's stack may have left Attempts whose leases have not
    # run out yet: the load is measured from here.
    before = fleet_row(dev_stack, worker_id).get("liveAttempts", 0)
    worker = Worker(dev_stack.path, tmp_path / "worker" / "inbox.db")
    try:
        running = operator.trigger(["sleep", "2"])
        operator.wait_for(running, RUN_STATE.RUN_STATE_RUNNING)
        (cordoned,) = admin_cli(dev_stack.path, "admin", "worker", "cordon", worker_id)
        assert cordoned["cordoned"] is True
        waiting = operator.trigger(["echo", "after maintenance"])
        operator.wait_for(running, RUN_STATE.RUN_STATE_SUCCEEDED)
        time.sleep(1)  # five more pulls, at least
        assert operator.run(waiting).state == RUN_STATE.RUN_STATE_QUEUED
        fleet = fleet_row(dev_stack, worker_id)
        assert fleet["cordoned"] is True
        assert fleet.get("liveAttempts", 0) <= before, "the finished Run no longer counts"
        admin_cli(dev_stack.path, "admin", "worker", "uncordon", worker_id)
        operator.wait_for(waiting, RUN_STATE.RUN_STATE_SUCCEEDED)
    finally:
        assert worker.stop() == 0, worker.log.read_text()
    after = fleet_row(dev_stack, worker_id)
    assert after["session"]["generation"] == fleet["session"]["generation"]


def fleet_row(dev_stack: DevStack, worker_id: str) -> dict[str, Any]:
    """The Worker's row of `qinglong worker list`."""
    (row,) = [w for w in admin_cli(dev_stack.path, "worker", "list") if w["workerId"] == worker_id]
    return row


def test_a_task_limited_to_one_run_never_runs_two_at_once(
    dev_stack: DevStack, operator: Operator, tmp_path: Path
) -> None:
    """Three Runs of a task limited to one Run at once, on a daemon that could run three:
    their executors' lifetimes, written by the executors themselves, never overlap, and
    each Run after the first waited CREATED until the one before it ended."""
    marks = tmp_path / "marks"
    script = f'echo "start $(date +%s%N)" >> {marks}; sleep 1; echo "end $(date +%s%N)" >> {marks}'
    task_id = operator.task(["sh", "-c", script], max_concurrent_runs=1)
    run_ids = [operator.trigger_task(task_id) for _ in range(3)]
    assert [operator.run(run_id).state for run_id in run_ids] == [
        RUN_STATE.RUN_STATE_QUEUED,
        RUN_STATE.RUN_STATE_CREATED,
        RUN_STATE.RUN_STATE_CREATED,
    ]
    worker = Worker(dev_stack.path, tmp_path / "worker" / "inbox.db", "--max-concurrency", "3")
    try:
        for run_id in run_ids:
            operator.wait_for(run_id, RUN_STATE.RUN_STATE_SUCCEEDED)
    finally:
        assert worker.stop() == 0, worker.log.read_text()
    lines = [line.split() for line in marks.read_text().splitlines()]
    assert [kind for kind, _ in lines] == ["start", "end"] * 3, "one executor at a time"
    moments = [int(at) for _, at in lines]
    assert moments == sorted(moments)
    for run_id in run_ids[1:]:
        types = operator.event_types(run_id)
        assert types[:2] == ["run.created", "run.queued"]
