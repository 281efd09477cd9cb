"""The Event timelines of a Run, as tests expect them (docs/protocol.md "States").

Written once so that a change to what a step appends is one edit here, not one per test.
"""

from __future__ import annotations

from typing import Final

#: Trigger, claim, the two start facts: the Events of a Run whose Attempt runs.
UNTIL_RUNNING: Final = (
    "run.queued",
    "attempt.claimed",
    "run.dispatching",
    "attempt.starting",
    "attempt.running",
    "run.running",
)
#: ... and whose Attempt then succeeded.
SUCCEEDED: Final = (*UNTIL_RUNNING, "attempt.succeeded", "run.succeeded")
#: One more Attempt after a retry: claim, start facts, success (no `run.queued` before it:
#: the retry's own `run.queued` comes from the retry authority).
RETRIED_AND_SUCCEEDED: Final = SUCCEEDED[1:]
