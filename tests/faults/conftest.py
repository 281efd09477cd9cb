"""Fixtures of the fault suite (issue 7, "Nothing lost").

Each test module gets its own real `qinglong up` (embedded PostgreSQL, control, ingress,
real mTLS), so a fault one scenario leaves behind cannot leak into another. Every test
prints its tally; the terminal summary repeats all of them in one table.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.devstack_process import DevStack
from tests.support.fault_rig import FaultRig, fault_stack
from tests.support.lossy_proxy import FaultSchedule
from tests.support.operator_client import OperatorClient


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    """Control's own timings (a 30 s lease), a reconcile every second."""
    with fault_stack() as up:
        yield up


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
