"""kill -9 of the Worker in the middle of a spawn, then a restart on the same inbox (issue 10).

Between persisting ``launching`` and persisting the executor's identity (``started``),
the Worker forks its executor's supervisor and waits for it to say that the executor
runs. A Worker killed in that window used to come back to a ``launching`` record with no
identity and report a start failure -- although the executor had started (and, if the
Worker died before the supervisor answered, was then killed with it): the Run ended
``failed`` with no exit code (``EXECUTOR_START_FAILED``), and a Run cancelled later, or
one whose executor exits 0, ended ``failed`` too. The replica load's Worker kill met it
in one of four soak runs.

Both halves of the window are hit exactly, with real processes and real signals: the
Worker is caught the moment its supervisor child exists (its interpreter needs far
longer than that to start the executor), then

* frozen (SIGSTOP) until its executor runs, and only then killed: the supervisor's
  answer is never read;
* killed at once, before the supervisor could answer at all, and restarted only after
  the executor ended on its own -- while no Worker lived.

Either way the restarted Worker must adopt the executor and report the exit status it
really had (exit 3: ``failed``, exit code 3), with one execution and no repeated Event.

A third case proves the fence that makes adopting safe: a launch that a restarted Worker
already declared "never started" can no longer be started by a supervisor that comes
late -- its executor never runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import psutil
import pytest
from qinglong_worker.launch import LaunchState, launch_key, resolve_launch
from qinglong_worker.process import ProcessController

from tests.support.executor_marks import is_alive
from tests.support.fault_rig import FaultRig
from tests.support.fault_tally import Tally, assert_verdict
from tests.support.polling import wait_until
from tests.support.worker_process import WorkerProcess

CONVERGE_SECONDS: Final = 45.0
SPAWN_SECONDS: Final = 30.0
MARK_SECONDS: Final = 10.0
EXECUTOR_SECONDS: Final = 1.0
EXIT_CODE: Final = 3


def _catch_spawn(worker: WorkerProcess, seconds: float) -> int | None:
    """Poll every millisecond (the window is tens of milliseconds) until the Worker has
    a supervisor child; its pid, or None."""
    deadline = time.monotonic() + seconds
    daemon = psutil.Process(worker.pid)
    while time.monotonic() < deadline:
        # The Worker's only children are supervisors (right after the fork one still
        # shows the Worker's own argv).
        with contextlib.suppress(psutil.Error):
            children = daemon.children()
            if children:
                return children[0].pid
        time.sleep(0.001)
    return None


def _inbox_state(inbox: Path, run_id: str) -> str | None:
    """The Run's record state in the inbox a dead Worker left."""
    with contextlib.closing(sqlite3.connect(inbox, timeout=5)) as conn:
        row = conn.execute("SELECT state FROM offers WHERE run_id = ?", (run_id,)).fetchone()
    return None if row is None else str(row[0])


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen-until-running", "dead-at-fork"])
def test_kill_9_between_fork_and_identity_then_restart(
    rig: FaultRig, report_tally: Callable[[Tally], None], frozen: bool
) -> None:
    worker = rig.worker(max_concurrency=1)
    run = rig.trigger("mid-spawn", seconds=EXECUTOR_SECONDS, exit_code=EXIT_CODE)
    worker.start()

    problems: list[str] = []
    supervisor = _catch_spawn(worker, SPAWN_SECONDS)
    if supervisor is None:
        problems.append("the Worker never spawned a supervisor")
    else:
        if frozen:
            os.kill(worker.pid, signal.SIGSTOP)
            if not wait_until(lambda: bool(rig.read_marks().of(run.run_id)), MARK_SECONDS):
                problems.append("the executor never started while its Worker was frozen")
        worker.kill9()
        if worker.wait() is None:
            problems.append("the Worker survived kill -9")
        state = _inbox_state(rig.inbox, run.run_id)
        if state != "launching":
            # Without this the test could pass without ever meeting the window.
            problems.append(f"the Worker died with its record {state}, not launching")
        if not frozen:
            # Let the executor run to its own end while no Worker lives at all.
            if not wait_until(lambda: bool(rig.read_marks().of(run.run_id)), MARK_SECONDS):
                problems.append("the executor never started after its Worker died")
            else:
                pid = rig.read_marks().of(run.run_id)[0].pid
                if not wait_until(lambda: not is_alive(pid), CONVERGE_SECONDS):
                    problems.append("the executor did not end while the Worker was down")
        ended = [e.exit_code for e in rig.read_marks().of(run.run_id)]
        if not frozen and ended != [EXIT_CODE]:
            problems.append(f"the executor's own ends were {ended}, not [{EXIT_CODE}]")
        worker.start()  # the same inbox, the same identity
        if not rig.wait_terminal(CONVERGE_SECONDS):
            problems.append(f"the Run was not terminal {CONVERGE_SECONDS:.0f} s after the restart")
    status = worker.stop()

    tally = rig.tally(f"kill -9 mid-spawn ({'frozen' if frozen else 'at fork'})", extra_faults=1)
    report_tally(tally)
    executions = rig.read_marks().of(run.run_id)
    if [e.exit_code for e in executions] != [EXIT_CODE]:
        problems.append(f"executions {executions}: one, ending {EXIT_CODE} by itself, expected")
    if status != 0:
        problems.append(f"the restarted Worker exited {status} on SIGINT, not 0")
    if problems or not tally.clean:
        problems.append("worker log tail:\n" + worker.log_tail())
    assert_verdict(tally, problems)


async def test_a_launch_declared_never_started_cannot_start_late(tmp_path: Path) -> None:
    """The fence: a restarted Worker settles a launch whose supervisor never reported as
    not started; a supervisor of that launch that starts afterwards must not run it."""
    exits, marker = tmp_path / "exits", tmp_path / "ran"
    controller = ProcessController(status_dir=exits)
    key = launch_key("offer-late", "attempt-late")

    verdict = resolve_launch(controller, key)
    assert verdict.state is LaunchState.NOT_STARTED
    with pytest.raises(FileExistsError):  # "error 17 LaunchFenced"
        await controller.spawn_async(
            ["sh", "-c", f"touch {marker}"],
            timeout_ms=None,
            deadline_unix_ms=None,
            launch_key=key,
        )
    await asyncio.sleep(0.3)  # an executor that had started would have left its marker
    assert not marker.exists(), "a fenced launch still ran its executor"
    # The fence holds for every later reader, and a second settling agrees.
    assert resolve_launch(controller, key).state is LaunchState.NOT_STARTED
