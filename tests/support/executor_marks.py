"""Executors that leave evidence of what really ran.

Each executor is a small shell script that appends ``start <run> <attempt> <pid>`` to a
marks file when it begins and ``end <run> <attempt> <pid> <code>`` just before it exits
on its own. The control plane's records can then be compared with what happened on the
machine: how many times a Run's command really started (nothing may run twice), whether
it finished by itself, and which exit status it really had. The pid also lets a test
wait for an executor to end, or clean one up, without asking the Worker.
"""

from __future__ import annotations

import contextlib
import shlex
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import psutil


@dataclass
class Execution:
    pid: int
    attempt_id: str
    exit_code: int | None = None
    """None while it runs, or when it was stopped before it could mark its end."""


@dataclass
class Marks:
    path: Path
    executions: dict[str, list[Execution]] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> Marks:
        executions: dict[str, list[Execution]] = defaultdict(list)
        by_pid: dict[int, Execution] = {}
        text = path.read_text() if path.exists() else ""
        for line in text.splitlines():
            kind, run_id, attempt_id, pid, *rest = line.split()
            if kind == "start":
                execution = Execution(int(pid), attempt_id)
                executions[run_id].append(execution)
                by_pid[int(pid)] = execution
            elif kind == "end" and int(pid) in by_pid:
                by_pid[int(pid)].exit_code = int(rest[0])
        return cls(path, dict(executions))

    def of(self, run_id: str) -> list[Execution]:
        return self.executions.get(run_id, [])

    def counts(self) -> dict[str, int]:
        return {run_id: len(found) for run_id, found in self.executions.items()}


def marked_command(marks: Path, *, seconds: float, exit_code: int) -> list[str]:
    """argv of an executor that runs `seconds` and then exits `exit_code`."""
    target = shlex.quote(str(marks))
    ids = '"$QINGLONG_RUN_ID" "${QINGLONG_ATTEMPT_ID:-none}" "$$"'
    script = (
        f"echo start {ids} >> {target}; "
        f"sleep {seconds}; "
        f"echo end {ids} {exit_code:d} >> {target}; "
        f"exit {exit_code:d}"
    )
    return ["sh", "-c", script]


def is_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie waiting for its reaper counts as exited."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _is_ours(pid: int, marks: Path) -> bool:
    """The pid still names one of this file's executors (never a reused pid)."""
    try:
        return str(marks).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def live_executors(marks: Path) -> list[int]:
    return [
        execution.pid
        for found in Marks.read(marks).executions.values()
        for execution in found
        if is_alive(execution.pid) and _is_ours(execution.pid, marks)
    ]


def kill_leftovers(marks: Path) -> list[int]:
    """SIGKILL every executor of `marks` still running, children first (its ``sleep``),
    whoever its parent is now. Returns the pids of the executors."""
    killed = live_executors(marks)
    for pid in killed:
        with contextlib.suppress(psutil.Error):
            executor = psutil.Process(pid)
            for child in executor.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.kill()
            executor.kill()
    return killed
