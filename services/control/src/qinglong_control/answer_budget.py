"""How long control may take to answer each command, whatever PostgreSQL does (R-ERR-2).

A command whose database stopped answering (a hung backend, a node gone from the network
without closing anything) must not hold its caller until the caller's own deadline: it is
answered STORAGE_UNAVAILABLE once its budget is spent, and its work unwinds on its own
(`ErrorInterceptor`, `qinglong_protocol.budget`). The budget must also leave a healthy
but slow command alone, so it depends on what the command is:

* a Worker's command — short by design (two round trips, locks held for milliseconds),
  with a replay rule for an unknown outcome, and sent by a Worker whose lease is running
  out while it waits — gets the storage bound (``--storage-timeout-seconds``, 2 s);
* an operator's or an administrator's command may wait on a lock or read a long page:
  it gets the statement bound (five times that, at least 5 s), the longest PostgreSQL
  itself lets one statement run;
* JoinWorker gets none: it spends a single-use token and has no replay, so its caller
  must get the answer of what happened (its own deadline bounds it).
"""

from __future__ import annotations

from typing import Final

from qinglong.worker.v1 import worker_service_pb2
from qinglong_protocol.storage import StorageBounds

#: RuntimeService's methods that forward a Worker's WorkerService call (same names).
WORKER_COMMANDS: Final = frozenset(
    method.name
    for method in worker_service_pb2.DESCRIPTOR.services_by_name["WorkerService"].methods
)
#: Commands answered however long they take: no replay could recover their outcome.
UNBOUNDED: Final = frozenset({"JoinWorker"})


def answer_budget(method: str, storage: StorageBounds) -> float | None:
    """Seconds within which control answers ``method`` (a RuntimeService method name);
    None: no budget of control's own."""
    if method in UNBOUNDED:
        return None
    if method in WORKER_COMMANDS:
        return storage.timeout_seconds
    return storage.statement_timeout_ms / 1000
