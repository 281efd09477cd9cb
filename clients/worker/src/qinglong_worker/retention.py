"""How long a Worker keeps what a finished Attempt left behind.

A closed inbox record, its log file (``logs/<offer>.log``) and its files in ``exits/``
(a launch claim the Worker wrote, a lease file) are of no use once the record owes
nothing: its output is shipped (or given up) and no executor of it may still run. Kept
for ever, they fill the disk — the documented "disk full: stop every executor" end — and
every record is a row the inbox carries. So the lifecycle removes them once they are
``retention`` old (by the record's last change, on the wall clock: a human's "7 days"),
a bounded batch at most every :data:`PRUNE_EVERY_SECONDS`. A record closed with its
executor unverified is kept (it is stopped again every tick); so is anything still
owed. The local copy of a Run's output goes with its record: read a Run's output from
the control plane (`qinglong run logs`), which keeps it by its own retention.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

from qinglong_worker import supervisor
from qinglong_worker.inbox import Inbox, InboxRecord
from qinglong_worker.launch import launch_key
from qinglong_worker.output import log_file
from qinglong_worker.process import ProcessController

log = logging.getLogger(__name__)

#: The default retention of a closed record and its files.
DEFAULT_RETENTION_DAYS: Final = 7.0
#: The shortest retention a Worker accepts (0, for ever, aside): longer than an offer
#: lives (control's offer lifetime is at most an hour), so that a record of a refused or
#: abandoned claim is not removed while its offer could still be pulled again.
MIN_RETENTION_DAYS: Final = 1.0
#: How often the lifecycle prunes (loop time), and how many records at most each time.
PRUNE_EVERY_SECONDS: Final = 600.0
PRUNE_BATCH: Final = 500


def prune(
    inbox: Inbox,
    processes: ProcessController,
    log_dir: Path | None,
    *,
    updated_before_unix_ms: int,
) -> int:
    """Remove up to :data:`PRUNE_BATCH` closed records last changed before the cutoff,
    and their files; how many records went."""
    removed = inbox.remove_closed(updated_before_unix_ms=updated_before_unix_ms, limit=PRUNE_BATCH)
    for record in removed:
        for path in _files_of(record, processes, log_dir):
            try:
                path.unlink(missing_ok=True)
            except OSError as error:
                log.warning("offer %s: %s not removed: %s", record.offer_id, path, error.strerror)
    if removed:
        log.info("removed %d closed inbox record(s) past their retention", len(removed))
    return len(removed)


def _files_of(
    record: InboxRecord, processes: ProcessController, log_dir: Path | None
) -> list[Path]:
    files = [] if log_dir is None else [log_file(log_dir, record.offer_id)]
    status_dir = processes.status_dir
    if status_dir is not None and record.attempt_id is not None:
        key = launch_key(record.offer_id, record.attempt_id)
        files += [
            status_dir / supervisor.launch_file_name(key),
            status_dir / supervisor.lease_file_name(key),
        ]
    return files
