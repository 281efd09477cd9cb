"""The Worker's two clocks, and which decisions each one may make.

* The **wall clock** (``time.time``) gives facts for humans and values that are wall-clock
  facts by nature: an inbox record's timestamps, and the deadline the control plane sent
  as a database timestamp, handed to the executor unchanged (SPEC R-TO-2). It decides
  nothing: NTP, a resumed VM or an administrator may step it, back or forward.
* The **boot clock** (Linux ``CLOCK_BOOTTIME``) measures the local lease estimate and
  every budget derived from it (when lease control is due, how long a lease-holding call
  may retry, when the lease has run out). It never steps; it keeps counting while the
  machine is suspended (the control plane's clock goes on meanwhile, so the lease must be
  seen to age: ``CLOCK_MONOTONIC`` would stop); and it is one clock for every process of a
  boot, so an observation a Worker persisted is still good for the Worker that restarts
  on the same inbox. Its readings mean something only within one boot: each is kept with
  the boot's id (``/proc/sys/kernel/random/boot_id``, read as the executor identities
  read it), and an observation made under another boot says the lease is lost — the
  executor ended with that boot anyway.

A wall-clock step therefore changes no lease decision: stepped back, the Worker does not
keep an executor running past the lease the control plane expires on its own clock (the
Run would run twice); stepped forward, it does not stop a healthy one.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from qinglong_worker import supervisor


@dataclass(frozen=True)
class BootInstant:
    """A reading of the boot clock: milliseconds since boot, and the boot (None where the
    kernel does not say; then only readings that say None too are comparable)."""

    boot_id: str | None
    ms: int


def wall_clock_ms() -> int:
    """Milliseconds since the Unix epoch: for humans and wall-clock facts only."""
    return time.time_ns() // 1_000_000


#: Milliseconds since boot, suspend included; never steps (the supervisor's lease watch
#: reads the same clock).
boot_clock_ms = supervisor.boot_clock_ms


def boot_clock_seconds() -> float:
    """Seconds since boot, suspend included: the clock of a lease-holding call's retry
    budget (a budget measured on ``CLOCK_MONOTONIC`` would stand still while the machine
    is suspended, and a retry loop resumed after it would outlive the lease)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@functools.cache
def this_boot() -> str | None:
    """The running boot's id (it cannot change while this process lives)."""
    return supervisor.boot_id()


def boot_now() -> BootInstant:
    """Now, on the clock the local lease is measured on."""
    return BootInstant(this_boot(), boot_clock_ms())


__all__ = [
    "BootInstant",
    "boot_clock_ms",
    "boot_clock_seconds",
    "boot_now",
    "this_boot",
    "wall_clock_ms",
]
