"""Settling a launch that a Worker crash interrupted: did the executor start, or not?

The inbox persists ``launching`` before the spawn and the supervisor's identity
(``started``) only after the supervisor answered that the executor runs. A Worker killed
in between comes back to a ``launching`` record with no identity, while the executor may
well run -- and end -- under a supervisor nobody knows. Reporting that as a start
failure ended such Runs ``failed`` with no exit code although the executor had exited
by itself (or succeeded, or was still running without anybody holding its lease).

So every spawn names a *launch claim*, ``<status dir>/launch-<key>.json``, created
exclusively (see :mod:`qinglong_worker.supervisor`): the supervisor claims it, naming
itself, before it starts the executor, and records its answer there before reporting
it. A restarted Worker settles the record by claiming the same file with no supervisor
in it:

* the Worker's claim wins: no supervisor started, or ever will start, the executor
  (one that comes late finds the claim taken and exits) -- ``not_started``;
* a supervisor's claim with ``ok <pid>``: the executor started -- ``started``, and the
  Worker adopts the supervisor's identity as if the spawn had answered;
* ``error <errno> <kind>``: the exec failed -- ``start_failed``, with that error;
* no answer yet: ``pending`` while the supervisor lives (it answers within moments);
  once it is gone without answering nothing runs -- ``not_started``.

The same settles a spawn whose supervisor was only slow to answer (its claim's fsyncs on
a slow disk: ``LaunchUnanswered``), in the Worker that spawned it; that Worker does not
claim the launch itself while its supervisor lives and has not claimed it yet.

The key is derived from the offer and the Attempt, so it names one record's one spawn.
A claim is removed once its record's identity is durable (or its start failure
reported); a Worker's own "not started" claim is kept, because a supervisor forked just
before the crash could still come, and must still find it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from qinglong_worker import supervisor
from qinglong_worker.process import ProcessController, ProcessIdentity, start_error

log = logging.getLogger(__name__)

_MAX_DOCUMENT_BYTES: Final = 4096


class LaunchState(StrEnum):
    NOT_STARTED = "not_started"
    STARTED = "started"
    START_FAILED = "start_failed"
    PENDING = "pending"


@dataclass(frozen=True)
class LaunchVerdict:
    state: LaunchState
    identity: ProcessIdentity | None = None
    """The supervisor's (``started``, and ``pending``: the one that claimed it)."""
    error: OSError | None = None
    """Why the exec failed (``start_failed``)."""


def launch_key(offer_id: str, attempt_id: str) -> str:
    """The launch claim's key of one record's spawn (a file name part, not a secret)."""
    return hashlib.sha256(f"{offer_id}\n{attempt_id}".encode()).hexdigest()[:32]


def resolve_launch(processes: ProcessController, key: str) -> LaunchVerdict:
    """Settle the launch ``key`` from a Worker that did not see its spawn answer. Raises
    OSError when the claim exists but cannot be read now: the launch stays undecided."""
    directory = processes.status_dir
    if directory is None:
        return LaunchVerdict(LaunchState.NOT_STARTED)  # nothing can have been spawned
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    slow = processes.unanswered_supervisor(key)
    if slow is not None and _read(processes, key) is None:
        # This Worker's own supervisor, slow to answer but alive, has not claimed the
        # launch yet: a claim of ours now would fence a start that is merely late.
        return LaunchVerdict(LaunchState.PENDING, slow)
    if supervisor.claim_launch(str(directory), key, None):
        return LaunchVerdict(LaunchState.NOT_STARTED)
    document = _read(processes, key)
    if document is None:
        log.warning("launch claim %s is malformed; treated as not started", key)
        return LaunchVerdict(LaunchState.NOT_STARTED)
    handle, answer = document.get("supervisor"), document.get("answer")
    if handle is None:
        return LaunchVerdict(LaunchState.NOT_STARTED)  # a Worker's own claim, earlier
    try:
        identity = ProcessIdentity.from_handle(str(handle))
        boot = document.get("boot")
        if isinstance(boot, str) and supervisor.is_boot_id(boot):
            identity = dataclasses.replace(identity, boot_id=boot)
    except ValueError:
        log.warning("launch claim %s names no supervisor; treated as not started", key)
        return LaunchVerdict(LaunchState.NOT_STARTED)
    if isinstance(answer, str):
        return _answered(identity, answer)
    if processes.poll(identity) is None:
        return LaunchVerdict(LaunchState.PENDING, identity)
    # Gone: it may have answered (and run a short executor to its end) since the read
    # above; the claim says so now if it did.
    again = _read(processes, key)
    answer = None if again is None else again.get("answer")
    if isinstance(answer, str):
        return _answered(identity, answer)
    # It ended between its claim and its answer: if its exec had happened, the
    # executor died with it (parent-death signal). Nothing runs.
    return LaunchVerdict(LaunchState.NOT_STARTED, identity)


def _answered(identity: ProcessIdentity, answer: str) -> LaunchVerdict:
    if answer.startswith("ok "):
        return LaunchVerdict(LaunchState.STARTED, identity)
    return LaunchVerdict(LaunchState.START_FAILED, identity, start_error(answer))


def forget_launch(processes: ProcessController, key: str) -> None:
    """Remove a supervisor's claim once the record no longer needs it. A Worker's own
    "not started" claim stays: it is what keeps a late supervisor from starting.
    Best effort: a claim left behind is a few bytes, and harmless."""
    if processes.status_dir is None:
        return
    try:
        document = _read(processes, key)
    except OSError as error:
        log.warning("launch claim %s not read, so not removed: %s", key, error.strerror)
        return
    if document is None or document.get("supervisor") is None:
        return
    try:
        (processes.status_dir / supervisor.launch_file_name(key)).unlink()
    except FileNotFoundError:
        pass
    except OSError as error:
        log.warning("launch claim %s not removed: %s", key, error.strerror)


def _read(processes: ProcessController, key: str) -> dict[str, Any] | None:
    if processes.status_dir is None:
        return None
    path = processes.status_dir / supervisor.launch_file_name(key)
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None  # absent: it names no supervisor we could adopt
    # Any other failure to read it (too many open files, an I/O error) is raised: a claim
    # that exists but could not be read may name a supervisor whose executor runs, so
    # the launch stays undecided until it can be read — never "not started".
    try:
        raw = os.read(descriptor, _MAX_DOCUMENT_BYTES)
    finally:
        os.close(descriptor)
    try:
        document: Any = json.loads(raw)
    except ValueError:
        return None
    if (
        not isinstance(document, dict)
        or document.get("version") != supervisor.LAUNCH_VERSION
        or document.get("launch") != key
    ):
        return None
    return document
