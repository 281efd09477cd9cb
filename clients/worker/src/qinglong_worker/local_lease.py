"""The local lease estimate, handed to the executor's supervisor (its lease watch).

R-W-2 step 3 stops an executor whose lease ran out locally — but only while a Worker
runs. A Worker that never comes back would leave the supervisor, and its executor,
running with no lease while the control plane expires it and starts the Run elsewhere.
So the record's estimate — the boot-clock instant at which the lease runs out, the same
one step 3 decides by — is also written where the supervisor looks
(``<status dir>/lease-<launch key>.json``, see :mod:`qinglong_worker.supervisor`):

* :func:`publish` each time the Worker persists a lease answer, or a change of state,
  while an executor may be started or running (``claimed`` .. ``running_acknowledged``):
  at the claim, before any supervisor exists, again as the start proceeds, and at each
  renewal. The inbox is written first; the file is a copy of what it holds, never ahead
  of it;
* :func:`withdraw` once the record knows its executor ended, or that it never started;
  a record closed with its executor unverified keeps the file, whose instant has passed:
  the supervisor stops what the Worker could not.

Both are best effort. A renewal that could not be written makes the supervisor stop its
executor at the previous instant, which the Worker then reads as a lost lease; if even
the claim's could not be written, the supervisor has no instant until a renewal writes
one (and a Worker that never returns leaves it unwatched, as before the watch existed).
They cost a small write per renewal, with no fsync: the only reader dies with the
machine.
"""

from __future__ import annotations

import logging
from typing import Final

from qinglong_worker import supervisor
from qinglong_worker.inbox import InboxRecord, QuarantineReason, RecordState
from qinglong_worker.launch import launch_key
from qinglong_worker.process import ProcessController

log = logging.getLogger(__name__)

#: Records whose executor may be started or running: the supervisor needs their lease.
MAY_RUN: Final = frozenset(
    {
        RecordState.CLAIMED,
        RecordState.LAUNCHING,
        RecordState.STARTED,
        RecordState.RUNNING_ACKNOWLEDGED,
    }
)


def _runs_out_at(record: InboxRecord) -> tuple[int, str | None] | None:
    observed = record.lease_observed
    if observed is None or record.lease_remaining_ms is None:
        return None
    return observed.ms + record.lease_remaining_ms, observed.boot_id


def follow(processes: ProcessController, before: InboxRecord, after: InboxRecord) -> None:
    """Keep the supervisor's copy in step with a record the Worker just persisted."""
    if processes.status_dir is None or after.attempt_id is None:
        return
    if after.state in MAY_RUN:
        runs_out = _runs_out_at(after)
        # At each change of state too (a few writes a Run): a record claimed before its
        # file could be written, or by a Worker that wrote none, gets one before its spawn.
        if runs_out is not None and (
            runs_out != _runs_out_at(before) or before.state is not after.state
        ):
            publish(processes, after, *runs_out)
    elif before.state in MAY_RUN and not _may_still_run(after):
        withdraw(processes, after)


def _may_still_run(record: InboxRecord) -> bool:
    return record.quarantine_reason is QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_UNVERIFIED


def publish(
    processes: ProcessController, record: InboxRecord, runs_out_ms: int, boot: str | None
) -> None:
    key = launch_key(record.offer_id, record.attempt_id or "")
    try:
        directory = processes.ensure_status_dir()
        supervisor.publish_lease(str(directory), key, runs_out_ms, boot)
    except OSError as error:
        log.warning(
            "offer %s: lease estimate not written for its supervisor (%s); it stops the"
            " executor at the previous one",
            record.offer_id,
            error.strerror,
        )


def withdraw(processes: ProcessController, record: InboxRecord) -> None:
    directory = processes.status_dir
    assert directory is not None
    key = launch_key(record.offer_id, record.attempt_id or "")
    try:
        (directory / supervisor.lease_file_name(key)).unlink()
    except FileNotFoundError:
        pass  # never written (no estimate yet), or the supervisor removed it as it ended
    except OSError as error:
        log.warning("offer %s: lease file not removed: %s", record.offer_id, error.strerror)
