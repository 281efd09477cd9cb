"""kill -9 of the Worker at each step of a Run, then a restart on the same inbox (issue 7).

The proxy kills the Worker at an exact point of one command: before the request reaches
ingress (REQUEST), or after control committed it but before the Worker saw the answer
(ANSWER). Either way the Worker dies without a chance to write anything more. Started
again on the same ``--inbox``, it must resume and bring the Run to the outcome its
executor really had -- exit 0 ends ``succeeded``, exit 3 ends ``failed`` with exit code
3 recorded -- with exactly one execution, one started Attempt and no repeated Event
(SPEC R-W-1, R-W-2, R-LC-8, R-W-6). Two cases let the executor end while no Worker is
alive at all: its exit status must survive the Worker (issue 7: "an executor supervisor
so exit status survives kill -9 of the Worker").
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import pytest
from qinglong.worker.v1 import worker_service_pb2 as ws

from tests.support.executor_marks import is_alive
from tests.support.fault_rig import FaultRig
from tests.support.fault_tally import Tally
from tests.support.lossy_proxy import Phase, act_at
from tests.support.polling import wait_until

CONVERGE_SECONDS: Final = 45.0
KILL_POINT_SECONDS: Final = 30.0
RESTART_SECONDS: Final = 30.0
MARK_SECONDS: Final = 5.0
EXECUTOR_SECONDS: Final = 2.0


@dataclass(frozen=True)
class KillPoint:
    name: str
    method: str
    phase: Phase
    exit_code: int
    call: int = 1
    executor_ends_while_down: bool = False
    """Restart only after the executor has ended on its own (no Worker alive meanwhile)."""


KILL_POINTS: Final = (
    KillPoint("after-pull", "PullOffers", Phase.ANSWER, exit_code=0),
    KillPoint("after-claim", "ClaimOffer", Phase.ANSWER, exit_code=0),
    KillPoint("after-starting", "AcknowledgeStarting", Phase.ANSWER, exit_code=3),
    KillPoint("spawned-before-running", "AcknowledgeRunning", Phase.REQUEST, exit_code=0),
    KillPoint("after-running", "AcknowledgeRunning", Phase.ANSWER, exit_code=3),
    KillPoint("during-run", "ControlLease", Phase.REQUEST, exit_code=0, call=2),
    KillPoint("renewal-committed", "ControlLease", Phase.ANSWER, exit_code=3, call=2),
    KillPoint(
        "exit-0-while-down",
        "ControlLease",
        Phase.REQUEST,
        exit_code=0,
        executor_ends_while_down=True,
    ),
    KillPoint(
        "exit-3-while-down",
        "ControlLease",
        Phase.REQUEST,
        exit_code=3,
        executor_ends_while_down=True,
    ),
    # A renewal control committed whose answer the Worker never kept, then the executor
    # ends by itself: the ending is reported at the stale version, refused as fenced, and
    # must be re-fenced by the renewal's replay (R-LC-8) rather than lose the Run.
    KillPoint(
        "renewal-committed-exit-0-while-down",
        "ControlLease",
        Phase.ANSWER,
        exit_code=0,
        executor_ends_while_down=True,
    ),
    KillPoint("before-complete", "CompleteAttempt", Phase.REQUEST, exit_code=0),
    KillPoint("after-complete", "CompleteAttempt", Phase.ANSWER, exit_code=3),
)


def _carries_offers(answer: bytes) -> bool:
    return len(ws.PullOffersResponse.FromString(answer).offers) > 0


@pytest.mark.parametrize("point", KILL_POINTS, ids=[point.name for point in KILL_POINTS])
def test_kill_9_at_each_step_then_restart_on_the_same_inbox(
    rig: FaultRig, report_tally: Callable[[Tally], None], point: KillPoint
) -> None:
    worker = rig.worker(max_concurrency=1)
    killed = threading.Event()

    def kill() -> None:
        worker.kill9()
        killed.set()

    rig.schedule.add(
        act_at(
            point.method,
            point.phase,
            kill,
            call=point.call,
            matches=_carries_offers if point.method == "PullOffers" else None,
        )
    )
    run = rig.trigger(point.name, seconds=EXECUTOR_SECONDS, exit_code=point.exit_code)
    worker.start()

    problems: list[str] = []
    if not killed.wait(KILL_POINT_SECONDS):
        problems.append(f"the Worker never reached {point.method} #{point.call} ({point.phase})")
    elif worker.wait() is None:
        problems.append("the Worker survived kill -9")
    else:
        if point.executor_ends_while_down:
            # The executor was spawned before the kill point; let it end while no Worker
            # lives (its start mark may trail the spawn by a moment).
            if not wait_until(lambda: bool(rig.read_marks().of(run.run_id)), MARK_SECONDS):
                problems.append("the executor had not started when the Worker was killed")
            else:
                pid = rig.read_marks().of(run.run_id)[0].pid
                if not wait_until(lambda: not is_alive(pid), CONVERGE_SECONDS):
                    problems.append("the executor did not end while the Worker was down")
        calls_before = sum(rig.schedule.calls.values())
        worker.start()  # the same argv: the same inbox, the same proxy
        # Its first call also means its signal handlers are in place for the stop below.
        if not wait_until(lambda: sum(rig.schedule.calls.values()) > calls_before, RESTART_SECONDS):
            problems.append("the restarted Worker never called ingress")
        if not rig.wait_terminal(CONVERGE_SECONDS):
            problems.append(f"the Run was not terminal {CONVERGE_SECONDS:.0f} s after the restart")
    status = worker.stop()

    tally = rig.tally(f"kill -9 {point.name}", extra_faults=0)
    report_tally(tally)
    rig.assert_restarted_worker_verdict(tally, problems, worker, status)
