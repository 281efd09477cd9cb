"""The fixed codes a Run or an Attempt ends with (``Run.error_code``, ``Attempt``'s too).

Low-cardinality and stable: users alert and branch on them. Each is written here once;
docs/protocol.md's "Ending codes" table says what each one means, and a test holds that
table to this module.
"""

from __future__ import annotations

from typing import Final

#: The executor ran and exited non-zero.
EXECUTION_FAILED: Final = "EXECUTION_FAILED"
#: A cancel intent (a user's, an approved agent's, a disabled project's, a draining
#: Worker's) ended it.
EXECUTION_CANCELLED: Final = "EXECUTION_CANCELLED"
#: The revision's execution timeout passed (counted from `starting`).
EXECUTION_TIMED_OUT: Final = "EXECUTION_TIMED_OUT"
#: The Worker could not start the executor (ReportStartFailure).
EXECUTOR_START_FAILED: Final = "EXECUTOR_START_FAILED"
#: The retry policy allowed no further Attempt (the Run's code; its last Attempt keeps
#: its own).
ATTEMPTS_EXHAUSTED: Final = "ATTEMPTS_EXHAUSTED"
#: No Worker claimed the Run within its plan's queue timeout.
QUEUE_TIMED_OUT: Final = "QUEUE_TIMED_OUT"
#: The Attempt's lease expired before its Worker reported (an Attempt's code; the Run
#: goes back to the queue, waits for a retry, or ends ATTEMPTS_EXHAUSTED).
LEASE_EXPIRED: Final = "LEASE_EXPIRED"
