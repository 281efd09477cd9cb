"""Control's servicer takes its bounds from qinglong_protocol.bounds, the one Python
source of the contract's ``Bound:``/``Range:`` comments, and its page-size default from
the same constant the contract's comments state (run_service.proto)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from qinglong_control import servicer
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_protocol import bounds

ROOT = Path(__file__).resolve().parents[2]
RUN_SERVICE_PROTO = ROOT / "proto/qinglong/control/v1/run_service.proto"
SERVICER = ROOT / "services/control/src/qinglong_control/servicer.py"


def test_page_size_zero_means_the_default_the_contract_states() -> None:
    stated = re.findall(r"0 means the default of (\d+)", RUN_SERVICE_PROTO.read_text())
    assert len(stated) == 2, "ListRuns and ListRunEvents each state their default"
    assert {int(value) for value in stated} == {bounds.PAGE_SIZE_DEFAULT}
    assert servicer._page_size(0) == bounds.PAGE_SIZE_DEFAULT
    assert servicer._page_size(1) == 1
    assert servicer._page_size(bounds.PAGE_SIZE_MAX) == bounds.PAGE_SIZE_MAX


@pytest.mark.parametrize("size", [-1, bounds.PAGE_SIZE_MAX + 1])
def test_a_page_size_out_of_range_is_refused_by_field(size: int) -> None:
    with pytest.raises(Refused) as refused:
        servicer._page_size(size)
    assert (refused.value.reason, refused.value.field) == (Reason.FIELD_INVALID, "page_size")


def test_the_servicer_writes_no_bound_of_its_own() -> None:
    """A bound written as a number here would drift from the contract (issue 8)."""
    numbers = {int(n) for n in re.findall(r"(?<![\w.^-])\d+(?![\w.])", SERVICER.read_text())}
    assert numbers <= {0, 1, 3}, sorted(numbers)
