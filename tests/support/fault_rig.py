"""One fault test's setting: a Worker identity behind its own lossy proxy, the Worker
processes a test starts on one inbox, the Runs it triggers with what each must end as,
and the cleanup that leaves nothing behind whatever the test's result.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType

import grpc
import psycopg
from qinglong_control.settings import ENV_RECONCILE_INTERVAL_SECONDS, ENV_TIMINGS_MS

from tests.support.devstack_process import DevStack, dev_stack
from tests.support.executor_marks import Marks, kill_leftovers, live_executors, marked_command
from tests.support.fault_tally import (
    Expected,
    Tally,
    assert_verdict,
    compute_tally,
    terminal_states,
    wait_until_terminal,
)
from tests.support.lossy_proxy import FaultSchedule, LossyProxy
from tests.support.operator_client import OperatorClient
from tests.support.worker_process import WorkerProcess

#: A path no machine has: the Worker cannot start it, so the Attempt ends in a start failure.
UNSTARTABLE: tuple[str, ...] = ("/nonexistent/qinglong-fault-executor",)


@contextlib.contextmanager
def fault_stack(timings_ms: Mapping[str, int] | None = None) -> Iterator[DevStack]:
    """A real `qinglong up` for one fault module, with control's `timings_ms` (by name,
    e.g. ``lease_ttl_ms``) and a reconcile cadence of 1 s instead of 2 (it only shortens
    the waits for expiry and convergence).

    Not under pytest's basetemp: another pytest session on the machine may prune it or
    tighten its root to 0700 at any time, and PostgreSQL runs as its own user here and
    must still reach its directory when a test starts it again."""
    root = Path(tempfile.mkdtemp(prefix="qinglong-faults-"))
    environment = {ENV_RECONCILE_INTERVAL_SECONDS: "1"}
    environment.update(
        {ENV_TIMINGS_MS[name]: str(value) for name, value in (timings_ms or {}).items()}
    )
    try:
        with dev_stack(root / "stack", environment=environment) as up:
            yield up
    finally:
        shutil.rmtree(root, ignore_errors=True)


class FaultRig:
    def __init__(
        self,
        stack: DevStack,
        operator: OperatorClient,
        directory: Path,
        schedule: FaultSchedule | None = None,
    ) -> None:
        self.stack = stack
        self.operator = operator
        self.directory = directory
        self.marks = directory / "executor-marks"
        self.inbox = directory / "worker" / "inbox.db"
        self.expected: list[Expected] = []
        self.workers: list[WorkerProcess] = []
        self.proxy = LossyProxy(
            upstream_address=stack.ingress_address,
            upstream_identity=stack.worker_tls,
            server_identity=stack.ingress_server_tls,
            allowed_peer_uri=stack.worker_uri,
            schedule=schedule,
        )

    @property
    def schedule(self) -> FaultSchedule:
        return self.proxy.schedule

    def __enter__(self) -> FaultRig:
        self.proxy.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for worker in self.workers:
            if worker.alive():
                worker.stop()
        self._cancel_unfinished()
        kill_leftovers(self.marks)
        self.proxy.stop()

    def _cancel_unfinished(self) -> None:
        """A Run left queued would be pulled by the next test's Worker: end it here."""
        with contextlib.suppress(psycopg.Error):
            states = terminal_states(self.stack.migration_url, self.run_ids)
            for run_id in self.run_ids:
                if states.get(run_id) not in ("succeeded", "failed", "cancelled", "timed_out"):
                    with contextlib.suppress(grpc.RpcError):
                        self.operator.cancel(run_id)

    # --- processes ------------------------------------------------------------------------

    def worker(
        self, *, max_concurrency: int = 2, extra_flags: tuple[str, ...] = ()
    ) -> WorkerProcess:
        """A Worker on this rig's inbox, through the proxy (not started yet)."""
        worker = WorkerProcess(
            self.stack,
            self.inbox,
            address=self.proxy.address,
            max_concurrency=max_concurrency,
            extra_flags=extra_flags,
        )
        self.workers.append(worker)
        return worker

    def live_executors(self) -> list[int]:
        return live_executors(self.marks)

    def read_marks(self) -> Marks:
        return Marks.read(self.marks)

    # --- runs -------------------------------------------------------------------------------

    @property
    def run_ids(self) -> list[str]:
        return [item.run_id for item in self.expected]

    def trigger(self, label: str, *, seconds: float, exit_code: int) -> Expected:
        """A Run whose executor runs `seconds` then exits `exit_code`: it must end
        succeeded (0) or failed (anything else), recording that exit code."""
        run_id = self.operator.trigger(
            marked_command(self.marks, seconds=seconds, exit_code=exit_code), name=label
        )
        expected = Expected(
            run_id,
            "succeeded" if exit_code == 0 else "failed",
            exit_code=exit_code,
            label=label,
        )
        self.expected.append(expected)
        return expected

    def trigger_unstartable(self, label: str) -> Expected:
        """A Run whose command cannot start: it must end failed, EXECUTOR_START_FAILED."""
        run_id = self.operator.trigger(list(UNSTARTABLE), name=label)
        expected = Expected(run_id, "failed", error_code="EXECUTOR_START_FAILED", label=label)
        self.expected.append(expected)
        return expected

    def expect(self, expected: Expected) -> None:
        """Replace what one Run must end as (e.g. a Run the test cancels)."""
        self.expected = [item for item in self.expected if item.run_id != expected.run_id]
        self.expected.append(expected)

    def wait_terminal(self, seconds: float) -> bool:
        return wait_until_terminal(self.stack.migration_url, self.run_ids, seconds)

    def tally(self, scenario: str, *, extra_faults: int = 0) -> Tally:
        return compute_tally(
            scenario,
            self.stack.migration_url,
            self.expected,
            schedule=self.schedule,
            executions=self.read_marks().counts(),
            extra_faults=extra_faults,
        )

    def noted_tally(
        self, scenario: str, note: str, report: Callable[[Tally], None], *, extra_faults: int
    ) -> Tally:
        """The tally, with the scenario's own counts (``note``) printed and kept in it,
        handed to the session's report."""
        print(note, flush=True)
        tally = self.tally(scenario, extra_faults=extra_faults)
        tally.notes.append(note)
        report(tally)
        return tally

    def assert_restarted_worker_verdict(
        self, tally: Tally, problems: list[str], worker: WorkerProcess, status: int
    ) -> None:
        """The end of a scenario whose Worker was started again and then stopped
        (``status``: its exit on SIGINT, which must be 0), leaving no executor running;
        any problem comes with the Worker's log tail."""
        if status != 0:
            problems.append(f"the restarted Worker exited {status} on SIGINT, not 0")
        if self.live_executors():
            problems.append(f"executors still running: {self.live_executors()}")
        if problems or not tally.clean:
            problems.append("worker log tail:\n" + worker.log_tail())
        assert_verdict(tally, problems)
