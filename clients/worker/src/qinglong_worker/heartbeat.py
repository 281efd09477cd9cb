"""The daemon's sign of life for a liveness probe: when its loop last began a tick.

A Worker whose event loop is stuck -- a call that blocks for ever on hung storage, a tick
waiting on something that never comes -- supervises nothing. Its executors' supervisors
stop them once their leases run out and the control plane retries the Runs elsewhere,
but the Worker itself would sit there for ever, taking no work and saying nothing.
``qinglong-worker probe`` lets an orchestrator restart it: it fails when the heartbeat
beside the inbox is older than ``--stale-seconds``.

The file holds the kernel's boot id and the boot clock (``CLOCK_BOOTTIME``: it never
jumps with the wall clock and counts a suspend) in seconds, rewritten in place, same
length each time, at every tick. A beat of another boot (the file survived a reboot on a
persistent volume) is stale whatever its number says. Nothing is fsynced: the probe runs
on the same kernel and reads the page cache.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from qinglong_worker.clock import boot_clock_seconds, this_boot

log = logging.getLogger(__name__)

#: The heartbeat's name, beside the inbox.
HEARTBEAT_FILE: Final = "heartbeat"
#: How old a heartbeat the probe still takes as alive. Ticks come every half second; a
#: tick that legitimately takes long (retries under its own bounds) stays well within.
DEFAULT_STALE_SECONDS: Final = 120.0
#: Fixed width: each beat overwrites the last whole, with no truncation in between.
_WIDTH: Final = 20
_NO_BOOT_ID: Final = "-" * 36
_MAX_BYTES: Final = 128

EXIT_ALIVE: Final = 0
EXIT_STALE: Final = 1
#: The daemon's own variable for its inbox (settings.py names it the same way; a test
#: compares them): the probe does not import the daemon's settings, a third of a second
#: of every probe's start.
INBOX_VARIABLE: Final = "QINGLONG_WORKER_INBOX"


def heartbeat_path(inbox: Path) -> Path:
    return inbox.parent / HEARTBEAT_FILE


class Heartbeat:
    """Rewrites the heartbeat file; a write that fails is logged once and retried at the
    next beat (the probe then sees an old beat, which is what it should see)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._descriptor: int | None = None
        self._failing = False

    def beat(self) -> None:
        text = f"{_this_boot()} {boot_clock_seconds():{_WIDTH}.3f}\n".encode("ascii")
        try:
            if self._descriptor is not None and os.fstat(self._descriptor).st_nlink == 0:
                self.close()  # removed (or replaced) under us: beats would go nowhere
            if self._descriptor is None:
                # Emptied once (whatever an earlier run left is not a beat of this one);
                # each beat after overwrites the last in place.
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
                self._descriptor = os.open(self.path, flags, 0o600)
            os.pwrite(self._descriptor, text, 0)
        except OSError as error:
            if not self._failing:
                log.warning("heartbeat %s not written: %s", self.path, error.strerror)
            self._failing = True
            self.close()
            return
        self._failing = False

    def close(self) -> None:
        if self._descriptor is not None:
            descriptor, self._descriptor = self._descriptor, None
            os.close(descriptor)


def _this_boot() -> str:
    return this_boot() or _NO_BOOT_ID  # read once per process


class OtherBoot(ValueError):
    """The heartbeat was written before the machine last booted."""


def heartbeat_age(path: Path, now: float | None = None) -> float:
    """Seconds since the last beat. Raises OSError if the file cannot be read,
    :class:`OtherBoot` if it was written in another boot, and ValueError if it holds no
    beat."""
    with open(path, "rb") as source:
        raw = source.read(_MAX_BYTES)
    written_in, beat = raw.decode("ascii").split()
    if written_in != _this_boot():
        raise OtherBoot(written_in)
    return (boot_clock_seconds() if now is None else now) - float(beat)


def probe_main(argv: Sequence[str]) -> int:
    """``qinglong-worker probe``: exit 0 while the daemon of this inbox ticks, else 1."""
    parser = argparse.ArgumentParser(
        prog="qinglong-worker probe",
        description="Liveness: is the Worker daemon of this inbox still ticking?",
    )
    parser.add_argument(
        "--inbox",
        type=Path,
        default=os.environ.get(INBOX_VARIABLE),
        help=f"the daemon's inbox; its heartbeat is beside it [${INBOX_VARIABLE}]",
    )
    parser.add_argument(
        "--stale-seconds",
        type=float,
        default=DEFAULT_STALE_SECONDS,
        help=f"an older heartbeat fails the probe [default: {DEFAULT_STALE_SECONDS:g}]",
    )
    args = parser.parse_args(argv)
    if args.inbox is None:
        parser.error("probe needs --inbox")
    if not args.stale_seconds > 0:
        parser.error("--stale-seconds must be positive")
    path = heartbeat_path(args.inbox)
    try:
        age = heartbeat_age(path)
    except OSError as error:
        print(f"no heartbeat at {path}: {error.strerror}")
        return EXIT_STALE
    except OtherBoot:
        print(f"stale: the heartbeat at {path} is of an earlier boot")
        return EXIT_STALE
    except ValueError:
        print(f"no heartbeat at {path}: it holds no beat")
        return EXIT_STALE
    if age > args.stale_seconds:
        print(f"stale: the Worker last ticked {age:.0f} s ago (limit {args.stale_seconds:g} s)")
        return EXIT_STALE
    print(f"alive: the Worker ticked {max(age, 0.0):.1f} s ago")
    return EXIT_ALIVE
