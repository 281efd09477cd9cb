"""Settling an interrupted launch from its claim (qinglong_worker.launch), on real files."""

from __future__ import annotations

import json
from pathlib import Path

from qinglong_worker import supervisor
from qinglong_worker.launch import LaunchState, resolve_launch
from qinglong_worker.process import ExitStatus, ProcessController, ProcessIdentity

KEY = "0123456789abcdef0123456789abcdef"
HANDLE = "pid:999999;start:1"


class AnswersWhilePolled(ProcessController):
    """A supervisor that answers ``ok`` (and, its executor short, ends) in the instant
    between the Worker's read of its claim and the Worker's look at whether it lives."""

    def poll(self, identity: ProcessIdentity) -> ExitStatus | None:
        assert self.status_dir is not None
        document = supervisor.launch_document(KEY, HANDLE, "ok 1000000", None)
        (self.status_dir / supervisor.launch_file_name(KEY)).write_text(json.dumps(document))
        return ExitStatus(0, None)


class EndsUnanswered(ProcessController):
    def poll(self, identity: ProcessIdentity) -> ExitStatus | None:
        return ExitStatus(None, None)


def test_a_supervisor_that_answered_just_before_it_was_seen_gone_is_started(
    tmp_path: Path,
) -> None:
    assert supervisor.claim_launch(str(tmp_path), KEY, HANDLE)  # claimed, no answer yet
    verdict = resolve_launch(AnswersWhilePolled(status_dir=tmp_path), KEY)
    assert verdict.state is LaunchState.STARTED
    assert verdict.identity is not None
    assert verdict.identity.handle == HANDLE


def test_a_supervisor_gone_without_an_answer_started_nothing(tmp_path: Path) -> None:
    assert supervisor.claim_launch(str(tmp_path), KEY, HANDLE)
    verdict = resolve_launch(EndsUnanswered(status_dir=tmp_path), KEY)
    assert verdict.state is LaunchState.NOT_STARTED
