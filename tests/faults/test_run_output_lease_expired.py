"""Run output printed while its Worker was down longer than the lease is not lost
(R-OPS-1).

Real processes only: `qinglong up` with a short lease (4 s, so the scenario takes
seconds), a `qinglong-worker run` behind the lossy proxy, and the `qinglong` CLI. The
executor prints a numbered line every few milliseconds. The proxy kills the Worker at
its 3rd AppendOutput, after control stored that chunk and before the Worker learnt so.
The executor keeps printing until its supervisor stops it, when the lease the Worker last
wrote for it runs out; the Worker is started again only after control expired the lease
(the Attempt is `lost`, the Run ends `failed`). The restarted Worker finds its lease gone
and the executor stopped: it closes the record without calling control — and then still
ships what the file holds beyond what control acknowledged, without a lease. `qinglong
run logs` must print exactly what the executor printed: every byte, in order, once,
including everything printed during the outage.
"""

from __future__ import annotations

import shlex
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import psycopg
import pytest
from qinglong_control.domain.timings import Timings

from tests.support.devstack_process import DevStack
from tests.support.fault_rig import FaultRig, fault_stack
from tests.support.fault_tally import Expected, Tally
from tests.support.lossy_proxy import Phase, act_at
from tests.support.polling import wait_until
from tests.support.run_output import read_back, stored_end

LEASE_TTL_MS: Final = 4_000
LINES: Final = 12_000  # at most a minute of printing, if nothing stops it
LINE_BYTES: Final = 64
KILL_AT_APPEND: Final = 3
KILL_SECONDS: Final = 60.0
#: Control expires the lease one lifetime after the last renewal (reconcile every 1 s).
EXPIRY_SECONDS: Final = 30.0
#: How long control counts on a Worker's stop without a lease (its default).
WORKER_STOP_SECONDS: Final = Timings().worker_stop_ms / 1000
SHIPPED_SECONDS: Final = 30.0

_PRINTER: Final = (
    "import sys, time\n"
    f"for n in range({LINES}):\n"
    f"    sys.stdout.write(f'{{n:08d}} ' + 'y' * {LINE_BYTES - 10} + '\\n')\n"
    "    sys.stdout.flush()\n"
    "    time.sleep(0.005)\n"
)


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    """This module's own stack, with a lease of a few seconds (the suite's is 30 s)."""
    with fault_stack({"lease_ttl_ms": LEASE_TTL_MS}) as up:
        yield up


def printed_lines(count: int) -> bytes:
    """The first `count` lines the executor prints, computed here independently."""
    return b"".join(f"{n:08d} ".encode() + b"y" * (LINE_BYTES - 10) + b"\n" for n in range(count))


def printing_command(marks: Path) -> list[str]:
    target = shlex.quote(str(marks))
    ids = '"$QINGLONG_RUN_ID" "${QINGLONG_ATTEMPT_ID:-none}" "$$"'
    script = (
        f"echo start {ids} >> {target}; "
        f"{shlex.quote(sys.executable)} -c {shlex.quote(_PRINTER)} || exit 1; "
        f"echo end {ids} 0 >> {target}"
    )
    return ["sh", "-c", script]


def attempt_states(migration_url: str, run_id: str) -> tuple[str, ...]:
    with psycopg.connect(migration_url, connect_timeout=5) as conn:
        rows = conn.execute(
            "SELECT state FROM qinglong.attempts WHERE run_id = %s ORDER BY attempt_number",
            (run_id,),
        ).fetchall()
    return tuple(str(state) for (state,) in rows)


def executor_file(rig: FaultRig) -> bytes:
    files = sorted((rig.inbox.parent / "logs").glob("*.log"))
    return files[0].read_bytes() if len(files) == 1 else b""


def test_output_printed_after_the_lease_expired_is_read_back_whole(
    rig: FaultRig, report_tally: Callable[[Tally], None]
) -> None:
    worker = rig.worker(max_concurrency=1)
    killed = threading.Event()

    def kill() -> None:
        worker.kill9()
        killed.set()

    rig.schedule.add(act_at("AppendOutput", Phase.ANSWER, kill, call=KILL_AT_APPEND))
    run_id = rig.operator.trigger(printing_command(rig.marks), name="unleased-output")
    # Nobody holds the lease once the Worker is gone: the Attempt ends lost, and with no
    # retry policy the Run fails.
    rig.expected.append(
        Expected(run_id, "failed", error_code="ATTEMPTS_EXHAUSTED", label="unleased output")
    )
    worker.start()

    problems: list[str] = []
    stored_at_kill = printed_at_restart = appends_before_restart = 0
    if not killed.wait(KILL_SECONDS):
        problems.append(f"the Worker never reached AppendOutput #{KILL_AT_APPEND}")
    elif worker.wait() is None:
        problems.append("the Worker survived kill -9")
    else:
        stored_at_kill, _ = stored_end(rig.stack.migration_url, run_id)
        if not wait_until(
            lambda: attempt_states(rig.stack.migration_url, run_id) == ("lost",),
            EXPIRY_SECONDS,
        ):
            problems.append("control never expired the dead Worker's lease")
        # The lease ran out on the Worker's clock no later than on control's, and the
        # supervisor's stop must end before control may start the Run again.
        if not wait_until(lambda: not rig.live_executors(), WORKER_STOP_SECONDS):
            problems.append("the executor printed on with no Worker and no lease")
        printed_at_restart = len(executor_file(rig))
        appends_before_restart = rig.schedule.calls["AppendOutput"]
        worker.start()
        if not wait_until(
            lambda: (
                bool(executor_file(rig))
                and stored_end(rig.stack.migration_url, run_id)[0] == len(executor_file(rig))
            ),
            SHIPPED_SECONDS,
        ):
            problems.append("the restarted Worker did not ship the rest of the file")
    rig.wait_terminal(EXPIRY_SECONDS)
    status = worker.stop()

    printed = executor_file(rig)
    back = read_back(rig.stack.stack_path, rig.stack.migration_url, run_id)
    appends = rig.schedule.calls["AppendOutput"]
    line = (
        f"run output after lease expiry: bytes printed {len(printed)}"
        f" (at the kill {stored_at_kill} stored, at the restart {printed_at_restart} printed),"
        f" bytes read {len(back.read)}, stored chunks {len(back.chunks)}, appends sent {appends}"
        f" ({appends - appends_before_restart} after the restart),"
        f" duplicate chunks {back.duplicate_chunks}, lost bytes {back.lost_bytes(printed)}"
    )
    tally = rig.noted_tally("run output after lease expiry", line, report_tally, extra_faults=0)
    problems += back.problems(printed)
    if len(printed) % LINE_BYTES or printed != printed_lines(len(printed) // LINE_BYTES):
        problems.append("the executor's file is not its numbered lines")
    if not len(printed) >= printed_at_restart > stored_at_kill:
        problems.append("nothing was printed between the kill and the restart")
    if appends <= appends_before_restart:
        problems.append("the restarted Worker shipped nothing")
    rig.assert_restarted_worker_verdict(tally, problems, worker, status)
