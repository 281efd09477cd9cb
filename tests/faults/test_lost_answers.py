"""Lost answers for every Worker command (issue 7).

The proxy forwards each request, lets ingress and control commit it, and then throws
the answer away, so the Worker sees UNAVAILABLE for a command that did happen. The
Worker must find its way back by retrying (exact replays, SPEC R-CLAIM-1, R-ACK-4/6,
R-FAIL-2, R-W-6, and the renewal replay of R-LC-8) and every Run must still end exactly
once, with the outcome its executor really had.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Final

from qinglong.worker.v1 import worker_service_pb2 as ws

from tests.support.fault_rig import FaultRig
from tests.support.fault_tally import Tally, assert_verdict
from tests.support.lossy_proxy import lose_answers, lose_every_nth_answer
from tests.support.polling import wait_until

#: Every command of qinglong.worker.v1.WorkerService.
WORKER_COMMANDS: Final = (
    "OpenSession",
    "RenewSession",
    "DrainSession",
    "PullOffers",
    "ClaimOffer",
    "AcknowledgeStarting",
    "AcknowledgeRunning",
    "ReportStartFailure",
    "ControlLease",
    "CompleteAttempt",
)
#: Longer than one lease lifetime (30 s) plus reconcile cycles: a Run a Worker abandoned
#: has been judged by control's expiry authority before it is counted.
CONVERGE_SECONDS: Final = 45.0
#: The session is renewed every third of its 30 s lifetime.
RENEWAL_SECONDS: Final = 30.0
EXIT_SECONDS: Final = 60.0


def _carries_offers(answer: bytes) -> bool:
    # An empty pull is no test of anything: lose only answers that hand out work.
    return len(ws.PullOffersResponse.FromString(answer).offers) > 0


def test_lost_answers_for_every_worker_command(
    rig: FaultRig, report_tally: Callable[[Tally], None]
) -> None:
    # The 1st and 3rd answer of each command: the 2nd is usually the retry of the 1st,
    # so a retry is never itself lost and every command meets a loss more than once.
    for command in WORKER_COMMANDS:
        if command in ("OpenSession", "RenewSession", "DrainSession", "ReportStartFailure"):
            rig.schedule.add(lose_answers(command, 1))
        elif command == "PullOffers":
            rig.schedule.add(lose_answers(command, 1, 3, matches=_carries_offers))
        else:
            rig.schedule.add(lose_answers(command, 1, 3))
    # Renewals are the most frequent command: lose some in the middle of runs too.
    rig.schedule.add(lose_every_nth_answer("ControlLease", 7))

    rig.trigger("ok-a", seconds=2.5, exit_code=0)
    rig.trigger("fails-a", seconds=2.5, exit_code=3)
    rig.trigger_unstartable("unstartable")
    rig.trigger("ok-b", seconds=2.5, exit_code=0)
    rig.trigger("fails-b", seconds=2.5, exit_code=3)
    worker = rig.worker(max_concurrency=2).start()

    problems: list[str] = []
    if not rig.wait_terminal(CONVERGE_SECONDS):
        problems.append(f"not every Run was terminal after {CONVERGE_SECONDS:.0f} s")
    if not wait_until(lambda: rig.schedule.faults["RenewSession"] > 0, RENEWAL_SECONDS):
        problems.append("no RenewSession answer was lost (was the session ever renewed?)")
    # SIGTERM: a Worker leaving drains its session (the last command left to test).
    worker.signal(signal.SIGTERM)
    status = worker.wait(EXIT_SECONDS)

    tally = rig.tally("lost answers, every Worker command")
    report_tally(tally)
    if status != 0:
        problems.append(f"the Worker exited {status} after SIGTERM, not 0")
    untested = [command for command in WORKER_COMMANDS if rig.schedule.faults[command] == 0]
    if untested:
        problems.append(f"no answer was lost for: {', '.join(untested)}")
    if rig.live_executors():
        problems.append(f"executors still running: {rig.live_executors()}")
    if problems:
        problems.append("worker log tail:\n" + worker.log_tail())
    assert_verdict(tally, problems)
