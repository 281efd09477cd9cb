"""Output a Worker ships after it reported the ending is still followed to its end
(R-OPS-1).

Real processes only: `qinglong up`, a `qinglong-worker run` behind the lossy proxy with a
one-second drain grace, and the `qinglong` CLI. The executor prints one chunk, then waits;
stopped (SIGTERM), it prints 4 MiB more and exits. The Worker is told to leave (SIGINT)
while it runs: when the drain grace has passed it stops the executor, ships one bounded
pass and reports the ending (the Run ends `cancelled`, for shutdown) with the size of the
output — most of it not shipped yet — and exits. A `run logs --follow` started before
must not end there: it waits, and once the Worker is started again and ships the rest
after the record closed, it prints every byte the executor printed, in order, once, and
ends by itself.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, Final

from tests.support.fault_rig import FaultRig
from tests.support.fault_tally import Expected, Tally
from tests.support.polling import wait_until
from tests.support.run_output import follow_problems, read_back, run_logs, stored_end

LINE_BYTES: Final = 64
FIRST_LINES: Final = 1_024  # 64 KiB while it runs
TOTAL_LINES: Final = FIRST_LINES + 65_536  # 4 MiB more once stopped
DRAIN_GRACE_SECONDS: Final = 1.0
RUNNING_SECONDS: Final = 60.0
EXIT_SECONDS: Final = 60.0
FOLLOW_END_SECONDS: Final = 90.0

#: Marks its start like the fault suite's executors; no end mark (it is stopped).
_EXECUTOR: Final = f"""
import os, signal, sys, time
marks = sys.argv[1]
ids = f"{{os.environ['QINGLONG_RUN_ID']}} {{os.environ.get('QINGLONG_ATTEMPT_ID', 'none')}}"
with open(marks, "a") as m:
    m.write(f"start {{ids}} {{os.getpid()}}\\n")

def lines(first, end):
    return "".join(f"{{n:08d}} " + "x" * {LINE_BYTES - 10} + "\\n" for n in range(first, end))

def stopped(signum, frame):
    sys.stdout.write(lines({FIRST_LINES}, {TOTAL_LINES}))
    sys.stdout.flush()
    os._exit(0)

signal.signal(signal.SIGTERM, stopped)
sys.stdout.write(lines(0, {FIRST_LINES}))
sys.stdout.flush()
while True:
    time.sleep(1)
"""


def printed_bytes() -> bytes:
    """What the executor prints in all, computed here independently of the executor."""
    return b"".join(
        f"{n:08d} ".encode() + b"x" * (LINE_BYTES - 10) + b"\n" for n in range(TOTAL_LINES)
    )


class Drained:
    """A pipe read to its end on a thread, so the writer never waits for the test."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self.data = bytearray()
        self._pipe = pipe
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe: IO[bytes]) -> None:
        while chunk := pipe.read1(1 << 16):  # type: ignore[attr-defined]
            self.data += chunk

    def join(self) -> bytes:
        self._thread.join(10)
        self._pipe.close()
        return bytes(self.data)


def test_follow_waits_for_output_shipped_after_a_shutdown_ending(
    rig: FaultRig, report_tally: Callable[[Tally], None]
) -> None:
    worker = rig.worker(
        max_concurrency=1, extra_flags=("--drain-grace-seconds", str(DRAIN_GRACE_SECONDS))
    )
    command = [
        "sh",
        "-c",
        f"exec {shlex.quote(sys.executable)} -c {shlex.quote(_EXECUTOR)} "
        f"{shlex.quote(str(rig.marks))}",
    ]
    run_id = rig.operator.trigger(command, name="output after shutdown")
    rig.expected.append(Expected(run_id, "cancelled", label="output after shutdown"))
    follower = run_logs(rig.stack.stack_path, run_id, "--follow")
    assert follower.stdout is not None
    assert follower.stderr is not None
    followed, notes = Drained(follower.stdout), Drained(follower.stderr)
    worker.start()

    problems: list[str] = []
    shortfall = 0
    if not wait_until(lambda: rig.schedule.calls["AppendOutput"] >= 1, RUNNING_SECONDS):
        problems.append("the Worker never shipped the first chunk")
    else:
        worker.signal(signal.SIGINT)
        first_status = worker.wait(EXIT_SECONDS)
        if first_status != 0:
            problems.append(f"the draining Worker exited {first_status}, not 0")
        held, reported = stored_end(rig.stack.migration_url, run_id)
        shortfall = (reported or 0) - held
        if reported != len(printed_bytes()):
            problems.append(f"the Worker reported {reported} bytes, not {len(printed_bytes())}")
        if shortfall <= 0:
            problems.append("all output was shipped before the ending: nothing was tested")
        if follower.poll() is not None:
            problems.append("`run logs --follow` ended while output was still to come")
        worker.start()  # ships the rest of the closed record
    try:
        follower.wait(FOLLOW_END_SECONDS)
    except subprocess.TimeoutExpired:
        follower.kill()
        follower.wait()
        problems.append("`run logs --follow` did not end once all output was shipped")
    printed, said = followed.join(), notes.join().decode(errors="replace")
    status = worker.stop()

    expected = printed_bytes()
    back = read_back(rig.stack.stack_path, rig.stack.migration_url, run_id)
    line = (
        f"run output after a shutdown ending: bytes printed {len(expected)}, not shipped at"
        f" the ending {shortfall}, followed {len(printed)}, read back {len(back.read)},"
        f" lost bytes {back.lost_bytes(expected)}, duplicate chunks {back.duplicate_chunks}"
    )
    scenario = "run output after a shutdown ending"
    tally = rig.noted_tally(scenario, line, report_tally, extra_faults=1)
    problems += back.problems(expected)
    problems += follow_problems(printed, expected, said, follower.returncode)
    if "still shipping" not in said:
        problems.append(f"`run logs --follow` never said it waited for shipping ({said!r})")
    rig.assert_restarted_worker_verdict(tally, problems, worker, status)
