"""Run output survives kill -9 of the Worker in the middle of shipping it (R-OPS-1).

Real processes only: `qinglong up`, a `qinglong-worker run` behind the lossy proxy, and
the `qinglong` CLI. The executor prints 1 MiB of numbered lines in bursts. The proxy
kills the Worker at its 8th AppendOutput, after control stored that chunk and before
the Worker learnt so (the answer is lost with it), so the restarted Worker re-sends a
chunk that is already stored. `qinglong run logs` must then print exactly what the
executor printed: every byte, in order, once. A `run logs --follow` started while the
Run is queued prints the same bytes and ends by itself when the Run is terminal.

And a Worker whose ``--output-limit-bytes`` is under what the executor prints keeps the
first part and a notice, exactly the limit, and the Run still succeeds.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from qinglong_worker.supervisor import OUTPUT_LIMIT_NOTICE

from tests.support.fault_rig import FaultRig
from tests.support.fault_tally import Expected, Tally
from tests.support.lossy_proxy import Phase, act_at
from tests.support.polling import wait_until
from tests.support.run_output import follow_problems, read_back, run_logs, stored_end

LINES: Final = 16_384
LINE_BYTES: Final = 64  # 16,384 lines of 64 bytes: 1 MiB
BURSTS: Final = 8
KILL_AT_APPEND: Final = 8
KILL_SECONDS: Final = 60.0
CONVERGE_SECONDS: Final = 60.0
FOLLOW_END_SECONDS: Final = 60.0

#: The executor: numbered lines of 64 bytes, in bursts with a pause between them, so
#: output is shipped while the Run runs as well as after it ended.
_PRINTER: Final = (
    "import sys, time\n"
    f"per_burst = {LINES // BURSTS}\n"
    f"for burst in range({BURSTS}):\n"
    "    for n in range(burst * per_burst, (burst + 1) * per_burst):\n"
    f"        sys.stdout.write(f'{{n:08d}} ' + 'x' * {LINE_BYTES - 10} + '\\n')\n"
    "    sys.stdout.flush()\n"
    "    time.sleep(0.3)\n"
)


def printed_bytes() -> bytes:
    """What the executor prints, computed here independently of the executor."""
    return b"".join(f"{n:08d} ".encode() + b"x" * (LINE_BYTES - 10) + b"\n" for n in range(LINES))


def printing_command(marks: Path, program: str = _PRINTER) -> list[str]:
    """A printer, wrapped in the fault suite's start/end marks (one execution each)."""
    target = shlex.quote(str(marks))
    ids = '"$QINGLONG_RUN_ID" "${QINGLONG_ATTEMPT_ID:-none}" "$$"'
    printer = shlex.quote(program)
    script = (
        f"echo start {ids} >> {target}; "
        f"{shlex.quote(sys.executable)} -c {printer} || exit 1; "
        f"echo end {ids} 0 >> {target}"
    )
    return ["sh", "-c", script]


def test_output_is_read_back_whole_after_kill_9_while_shipping(
    rig: FaultRig, report_tally: Callable[[Tally], None]
) -> None:
    worker = rig.worker(max_concurrency=1)
    killed = threading.Event()

    def kill() -> None:
        worker.kill9()
        killed.set()

    rig.schedule.add(act_at("AppendOutput", Phase.ANSWER, kill, call=KILL_AT_APPEND))
    run_id = rig.operator.trigger(printing_command(rig.marks), name="output")
    rig.expected.append(Expected(run_id, "succeeded", exit_code=0, label="output"))
    follower = run_logs(rig.stack.stack_path, run_id, "--follow")
    worker.start()

    problems: list[str] = []
    if not killed.wait(KILL_SECONDS):
        problems.append(f"the Worker never reached AppendOutput #{KILL_AT_APPEND}")
    elif worker.wait() is None:
        problems.append("the Worker survived kill -9")
    else:
        calls_before = sum(rig.schedule.calls.values())
        worker.start()
        if not wait_until(lambda: sum(rig.schedule.calls.values()) > calls_before, 30.0):
            problems.append("the restarted Worker never called ingress")
        if not rig.wait_terminal(CONVERGE_SECONDS):
            problems.append(f"the Run was not terminal {CONVERGE_SECONDS:.0f} s after the restart")
    try:
        followed, follow_err = follower.communicate(timeout=FOLLOW_END_SECONDS)
    except subprocess.TimeoutExpired:
        follower.kill()
        followed, follow_err = follower.communicate()
        problems.append("`run logs --follow` did not end after the Run was terminal")
    status = worker.stop()

    expected = printed_bytes()
    back = read_back(rig.stack.stack_path, rig.stack.migration_url, run_id)
    appends = rig.schedule.calls["AppendOutput"]
    line = (
        f"run output kill -9: bytes printed {len(expected)}, bytes read {len(back.read)},"
        f" stored chunks {len(back.chunks)}, appends sent {appends}"
        f" (re-sent {appends - len(back.chunks)}), duplicate chunks {back.duplicate_chunks},"
        f" lost bytes {back.lost_bytes(expected)}"
    )
    tally = rig.noted_tally("run output kill -9", line, report_tally, extra_faults=0)
    problems += back.problems(expected)
    problems += follow_problems(followed, expected, follow_err.decode(), follower.returncode)
    if appends <= len(back.chunks):
        problems.append("no chunk was re-sent: the kill did not land between commit and answer")
    rig.assert_restarted_worker_verdict(tally, problems, worker, status)


#: Printed at once, then the executor ends: shipped after it ended, pass after pass.
BURST_LINES: Final = 8 * 1024 * 1024 // 128
_BURST_PRINTER: Final = f"import sys\nsys.stdout.write(('y' * 127 + '\\n') * {BURST_LINES})\n"


def test_a_large_output_printed_at_the_end_is_whole_before_the_run_ends(
    rig: FaultRig, report_tally: Callable[[Tally], None]
) -> None:
    """8 MiB printed in one go by an executor that then exits: the Worker ships it over
    several passes after the exit, and only then reports the ending, so the Run is
    terminal with every byte stored. Prints how long the Run's end waited for it."""
    worker = rig.worker(max_concurrency=1).start()
    started = time.monotonic()
    run_id = rig.operator.trigger(printing_command(rig.marks, _BURST_PRINTER), name="burst")
    rig.expected.append(Expected(run_id, "succeeded", exit_code=0, label="output burst"))
    problems: list[str] = []
    if not rig.wait_terminal(CONVERGE_SECONDS):
        problems.append(f"the Run was not terminal after {CONVERGE_SECONDS:.0f} s")
    seconds = time.monotonic() - started
    shipped, reported = stored_end(rig.stack.migration_url, run_id)
    status = worker.stop()

    expected = b"y" * 127 + b"\n"
    expected *= BURST_LINES
    line = (
        f"run output burst: bytes printed {len(expected)}, stored when the Run ended {shipped},"
        f" reported with the ending {reported}; trigger to terminal {seconds:.1f} s"
        f" ({len(expected) / 2**20 / seconds:.1f} MiB/s)"
    )
    tally = rig.noted_tally("run output burst", line, report_tally, extra_faults=0)
    problems += read_back(rig.stack.stack_path, rig.stack.migration_url, run_id).problems(expected)
    if (shipped, reported) != (len(expected), len(expected)):
        problems.append("the Run ended before its output was stored whole")
    rig.assert_restarted_worker_verdict(tally, problems, worker, status)


#: A Worker limit well under what the printer prints.
OUTPUT_LIMIT_BYTES: Final = 256 * 1024


def test_output_past_the_workers_limit_ends_with_the_notice_and_the_run_succeeds(
    rig: FaultRig, report_tally: Callable[[Tally], None]
) -> None:
    """``--output-limit-bytes``: the Worker's file, and so what control holds, is the
    first part of the output and the notice, exactly the limit; the executor runs on to
    its own end (the Run succeeds, not failed for what it printed)."""
    worker = rig.worker(
        max_concurrency=1, extra_flags=("--output-limit-bytes", str(OUTPUT_LIMIT_BYTES))
    ).start()
    run_id = rig.operator.trigger(printing_command(rig.marks), name="output-limit")
    rig.expected.append(Expected(run_id, "succeeded", exit_code=0, label="output limit"))
    problems: list[str] = []
    if not rig.wait_terminal(CONVERGE_SECONDS):
        problems.append(f"the Run was not terminal after {CONVERGE_SECONDS:.0f} s")
    status = worker.stop()

    notice = OUTPUT_LIMIT_NOTICE.format(limit=OUTPUT_LIMIT_BYTES).encode()
    expected = printed_bytes()[: OUTPUT_LIMIT_BYTES - len(notice)] + notice
    back = read_back(rig.stack.stack_path, rig.stack.migration_url, run_id)
    shipped, reported = stored_end(rig.stack.migration_url, run_id)
    line = (
        f"run output limit: bytes printed {len(printed_bytes())}, limit {OUTPUT_LIMIT_BYTES},"
        f" bytes read {len(back.read)}, stored {shipped}, reported with the ending {reported}"
    )
    tally = rig.noted_tally("run output limit", line, report_tally, extra_faults=0)
    problems += back.problems(expected)
    if reported != OUTPUT_LIMIT_BYTES:
        problems.append(f"the Worker reported {reported} output bytes, not the limit")
    rig.assert_restarted_worker_verdict(tally, problems, worker, status)
