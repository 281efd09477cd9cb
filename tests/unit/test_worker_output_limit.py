"""The output limit (the supervisor's "The output limit"): an executor's log file never grows
past the Worker's ``--output-limit-bytes``, and the executor is neither stopped nor held up
by it. Real supervisors and executors; the disk that fills is ``/dev/full``."""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
from qinglong_protocol import bounds
from qinglong_worker.process import (
    SUPERVISOR_SCRIPT,
    ExitStatus,
    ProcessController,
    ProcessIdentity,
    StopResult,
)
from qinglong_worker.settings import parse_worker_settings
from qinglong_worker.supervisor import EXIT_NOT_STARTED, OUTPUT_LIMIT_NOTICE, OutputRelay

from tests.support.polling import wait_until

LIMIT: Final = 100_000
#: Far more than the limit, and more than a pipe holds: an executor the relay stopped
#: reading would block on it and never exit.
WRITTEN: Final = 1_000_000
LAUNCH_KEY: Final = "cd" * 16
_WRITER: Final = """
import os, sys
total, exit_code = int(sys.argv[1]), int(sys.argv[2])
block = bytes(range(256)) * 256
done = 0
while done < total:
    done += os.write(1, block[: total - done])
os.write(2, b"the end\\n")
sys.exit(exit_code)
"""


def _written(count: int) -> bytes:
    """The first ``count`` bytes :data:`_WRITER` writes."""
    return (bytes(range(256)) * (count // 256 + 1))[:count]


def _notice(limit: int = LIMIT) -> bytes:
    return OUTPUT_LIMIT_NOTICE.format(limit=limit).encode()


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[ProcessController]:
    processes = ProcessController(
        base_environment={"PATH": os.environ["PATH"]},
        status_dir=tmp_path / "exits",
        output_limit_bytes=LIMIT,
    )
    yield processes
    asyncio.run(processes.stop_all(grace_seconds=0.0))  # never leave a test process behind


def _spawn(
    controller: ProcessController, argv: list[str], log: Path, *, launch_key: str | None = None
) -> ProcessIdentity:
    return asyncio.run(
        controller.spawn_async(
            argv, timeout_ms=None, deadline_unix_ms=None, log_path=log, launch_key=launch_key
        )
    )


def _ended(controller: ProcessController, identity: ProcessIdentity) -> ExitStatus:
    status: list[ExitStatus] = []

    def polled() -> bool:
        found = controller.poll(identity)
        if found is not None:
            status.append(found)
        return bool(status)

    assert wait_until(polled, 30.0), "the executor never ended"
    return status[0]


@pytest.mark.parametrize("launch_key", [None, LAUNCH_KEY], ids=["plain", "lease-watched"])
def test_output_past_the_limit_is_discarded_after_a_notice_and_the_executor_runs_on(
    controller: ProcessController, tmp_path: Path, launch_key: str | None
) -> None:
    log = tmp_path / "offer.log"
    argv = [sys.executable, "-c", _WRITER, str(WRITTEN), "7"]
    identity = _spawn(controller, argv, log, launch_key=launch_key)
    assert _ended(controller, identity) == ExitStatus(7, None), "its own exit, not a stop"
    content = log.read_bytes()
    print(f"written {WRITTEN} bytes, the file holds {len(content)} (limit {LIMIT})")
    assert len(content) == LIMIT
    assert content == _written(LIMIT - len(_notice())) + _notice()


def test_output_within_the_limit_is_kept_whole_stdout_and_stderr_in_order(
    controller: ProcessController, tmp_path: Path
) -> None:
    log = tmp_path / "offer.log"
    identity = _spawn(controller, [sys.executable, "-c", _WRITER, "5000", "0"], log)
    assert _ended(controller, identity) == ExitStatus(0, None)
    assert log.read_bytes() == _written(5000) + b"the end\n"


def test_the_limit_counts_what_the_file_held_already(
    controller: ProcessController, tmp_path: Path
) -> None:
    log = tmp_path / "offer.log"
    log.write_bytes(b"x" * (LIMIT - 1000))
    identity = _spawn(controller, [sys.executable, "-c", _WRITER, "5000", "0"], log)
    assert _ended(controller, identity) == ExitStatus(0, None)
    content = log.read_bytes()
    assert len(content) == LIMIT
    assert content.endswith(_written(1000 - len(_notice())) + _notice())


def test_a_file_too_full_for_the_notice_takes_nothing_more(
    controller: ProcessController, tmp_path: Path
) -> None:
    """Not even the notice goes past the limit."""
    log = tmp_path / "offer.log"
    log.write_bytes(b"x" * (LIMIT - len(_notice()) // 2))
    identity = _spawn(controller, [sys.executable, "-c", _WRITER, "5000", "0"], log)
    assert _ended(controller, identity) == ExitStatus(0, None)
    assert log.read_bytes() == b"x" * (LIMIT - len(_notice()) // 2)


def test_finish_takes_what_the_pipe_holds_though_a_writer_keeps_it_open(tmp_path: Path) -> None:
    """After the executor ended, a process it left in the background may hold the pipe
    for ever: the copy takes what is there and ends, without waiting for an end of file."""
    source, writer = os.pipe()
    pending = _written(50_000)
    os.write(writer, pending)  # within a pipe's 64 KiB
    with (tmp_path / "offer.log").open("ab") as target:
        relay = OutputRelay(source, target.fileno(), LIMIT)
        relay.start()
        assert relay.finish(), "the copy ended though the pipe is still open"
    os.close(writer)
    os.close(source)
    assert (tmp_path / "offer.log").read_bytes() == pending


def _blocked_signals(pid: int) -> dict[int, set[int]]:
    """The signals each thread of ``pid`` blocks, by thread id (``SigBlk`` of its task)."""
    blocked = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        line = next(
            line
            for line in (task / "status").read_text().splitlines()
            if line.startswith("SigBlk:")
        )
        mask = int(line.split()[1], 16)
        blocked[int(task.name)] = {number for number in range(1, 65) if mask >> (number - 1) & 1}
    return blocked


def test_the_relays_thread_blocks_every_signal_the_supervisor_waits_for(
    controller: ProcessController, tmp_path: Path
) -> None:
    """A signal the relay's thread took would be lost to the main thread: SIGCHLD (the
    lease watch's ``sigtimedwait`` would wake only at its next look) and the stop signals
    it forwards. The main thread blocks none of the stop signals, as before."""
    log = tmp_path / "offer.log"
    identity = _spawn(
        controller, ["sh", "-c", "echo started; exec sleep 300"], log, launch_key=LAUNCH_KEY
    )
    assert wait_until(lambda: log.read_bytes() == b"started\n", 10.0)
    blocked = _blocked_signals(identity.pid)
    main = blocked.pop(identity.pid)
    assert len(blocked) == 1, "the supervisor has one thread besides its main one"
    (relay,) = blocked.values()
    waited_for = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    assert waited_for <= relay
    # (SIGCHLD the main thread blocks, but not while it waits for it in sigtimedwait.)
    assert not {signal.SIGTERM, signal.SIGINT, signal.SIGHUP} & main


def test_without_a_descriptor_for_the_pipe_the_start_fails_and_says_why(tmp_path: Path) -> None:
    """EMFILE when the supervisor makes the executor's pipe: reported on the ready
    descriptor like any failed start (the Worker reports it, or gives it back as the
    machine's fault), never a supervisor that dies without an answer."""
    ready_read, ready_write = os.pipe()
    marker = tmp_path / "ran"

    def few_descriptors() -> None:
        # Enough for the interpreter's start, none to spare for two pipes.
        resource.setrlimit(resource.RLIMIT_NOFILE, (5, 5))

    with (tmp_path / "offer.log").open("ab") as log:
        supervisor_process = subprocess.Popen(
            [
                sys.executable,
                "-I",
                str(SUPERVISOR_SCRIPT),
                *("--status-dir", str(tmp_path), "--ready-fd", str(ready_write)),
                *("--output-limit", str(LIMIT), "--", "touch", str(marker)),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            pass_fds=(ready_write,),
            preexec_fn=few_descriptors,
        )
    os.close(ready_write)
    with os.fdopen(ready_read, "rb") as ready:
        answer = ready.read().decode()
    assert supervisor_process.wait(timeout=30) == EXIT_NOT_STARTED
    assert answer.startswith(f"error {errno.EMFILE} "), answer
    assert not marker.exists()


def test_without_a_limit_the_file_takes_everything(tmp_path: Path) -> None:
    unbounded = ProcessController(
        base_environment={"PATH": os.environ["PATH"]},
        status_dir=tmp_path / "exits",
        output_limit_bytes=None,
    )
    log = tmp_path / "offer.log"
    identity = _spawn(unbounded, [sys.executable, "-c", _WRITER, str(WRITTEN), "0"], log)
    assert _ended(unbounded, identity) == ExitStatus(0, None)
    assert log.read_bytes() == _written(WRITTEN) + b"the end\n"


def test_a_full_disk_neither_stops_nor_holds_up_the_executor(
    controller: ProcessController,
) -> None:
    """Every write to ``/dev/full`` fails ENOSPC: the relay writes no more and still
    drains the pipe, so the executor writes all it has and exits with its own status."""
    identity = _spawn(
        controller, [sys.executable, "-c", _WRITER, str(WRITTEN), "5"], Path("/dev/full")
    )
    assert _ended(controller, identity) == ExitStatus(5, None)


def test_a_background_process_holding_the_pipe_does_not_hold_up_the_ending(
    controller: ProcessController, tmp_path: Path
) -> None:
    """``sleep &`` inherits the pipe and never closes it: the executor's end is still
    reported (what was in the pipe copied first), and step 5 ends the sleeper."""
    log = tmp_path / "offer.log"
    marker = tmp_path / "sleeper.pid"
    script = f'sleep 300 & echo $! > "{marker}"; echo done'
    identity = _spawn(controller, ["sh", "-c", script], log, launch_key=LAUNCH_KEY)
    assert _ended(controller, identity) == ExitStatus(0, None)
    assert log.read_bytes() == b"done\n"
    sleeper = int(marker.read_text())
    assert wait_until(lambda: not _alive(sleeper), 10.0), "the background sleeper lives on"


@pytest.mark.parametrize("launch_key", [None, LAUNCH_KEY], ids=["plain", "lease-watched"])
def test_a_stop_reaches_the_executor_at_once_while_the_output_is_relayed(
    controller: ProcessController, tmp_path: Path, launch_key: str | None
) -> None:
    """The supervisor has a second thread now; the stop signal must still be forwarded by
    its main thread at once, in the plain wait (``waitpid``) and in the lease watch."""
    log = tmp_path / "offer.log"
    identity = _spawn(
        controller, ["sh", "-c", "echo started; exec sleep 300"], log, launch_key=launch_key
    )
    assert wait_until(lambda: log.read_bytes() == b"started\n", 10.0)
    began = time.monotonic()
    stopped = asyncio.run(controller.stop(identity, grace_seconds=60.0))
    took = time.monotonic() - began
    print(f"stopped in {took:.2f} s")
    assert stopped is StopResult.STOPPED
    assert took < 30.0, f"the stop took {took:.1f} s: SIGTERM was not forwarded"
    assert controller.poll(identity) == ExitStatus(None, signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


_CONNECTION: Final = [
    "run",
    *("--worker-id", "w", "--ingress-address", "i:1", "--inbox", "/tmp/i.db"),
    *("--tls-ca", "a", "--tls-cert", "b", "--tls-key", "c"),
]


@pytest.mark.parametrize(
    ("flag", "limit"),
    [
        (None, bounds.OUTPUT_BYTES_PER_ATTEMPT_DEFAULT),
        ("0", None),
        (str(bounds.OUTPUT_CHUNK_MAX_BYTES), bounds.OUTPUT_CHUNK_MAX_BYTES),
        ("1073741824", 1073741824),
    ],
)
def test_the_limit_flag(flag: str | None, limit: int | None) -> None:
    argv = [*_CONNECTION, *(() if flag is None else ("--output-limit-bytes", flag))]
    daemon = parse_worker_settings(argv)[1].daemon
    assert daemon is not None
    assert daemon.output_limit_bytes == limit


@pytest.mark.parametrize("flag", ["1", "-5", str(bounds.OUTPUT_CHUNK_MAX_BYTES - 1)])
def test_a_limit_below_one_chunk_is_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        parse_worker_settings([*_CONNECTION, "--output-limit-bytes", flag])
    assert refused.value.code == 2
    assert "--output-limit-bytes must be 0 (without bound) or at least" in capsys.readouterr().err
