"""Fixtures of the fault suite (issue 7, "Nothing lost").

Each test module gets its own real `qinglong up` (embedded PostgreSQL, control, ingress,
real mTLS), so a fault one scenario leaves behind cannot leak into another. Every test
prints its tally; the terminal summary repeats all of them in one table.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from qinglong_control.settings import ENV_RECONCILE_INTERVAL_SECONDS

from tests.support.devstack_process import DevStack, dev_stack
from tests.support.fault_rig import FaultRig
from tests.support.lossy_proxy import FaultSchedule
from tests.support.operator_client import OperatorClient


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    # Not under pytest's basetemp: another pytest session on the machine may prune it or
    # tighten its root to 0700 at any time, and PostgreSQL runs as its own user here and
    # must still reach its directory when a test starts it again.
    root = Path(tempfile.mkdtemp(prefix="qinglong-faults-"))
    try:
        # A faster reconcile cadence than the default 2 s only shortens the waits for
        # expiry and convergence; the lease lifetime (30 s) is control's own, unchanged.
        with dev_stack(root / "stack", environment={ENV_RECONCILE_INTERVAL_SECONDS: "1"}) as up:
            yield up
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def operator(stack: DevStack) -> Iterator[OperatorClient]:
    client = OperatorClient(stack)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def rig(stack: DevStack, operator: OperatorClient, tmp_path: Path) -> Iterator[FaultRig]:
    """A lossy proxy for the stack's Worker identity, with no fault scheduled yet (tests
    add rules); cleaned up after the test: Workers stopped, unfinished Runs cancelled,
    leftover executors killed."""
    with FaultRig(stack, operator, tmp_path, FaultSchedule()) as built:
        yield built
