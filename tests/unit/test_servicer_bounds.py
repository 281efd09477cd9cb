"""Control enforces the contract's own field rules on what ingress forwards, and keeps no
copy of any bound: the servicers and their wire modules only convert (issue 8). The
numbers only the contract's comments can state (page-size default, list caps, the join
token's default lifetime, token lengths) are constants held to those comments."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
from qinglong.control.v1 import run_service_pb2
from qinglong.runtime.v1 import runtime_service_pb2
from qinglong_control import wire
from qinglong_control.contract_bounds import check_public_request, public_request_types
from qinglong_control.db.placement import Offers, PlacedOffer
from qinglong_control.domain import administration
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.server import RUNTIME_SERVICE
from qinglong_protocol import bounds

ROOT = Path(__file__).resolve().parents[2]
RUN_SERVICE_PROTO = ROOT / "proto/qinglong/control/v1/run_service.proto"
TASK_SERVICE_PROTO = ROOT / "proto/qinglong/control/v1/task_service.proto"
ADMIN_SERVICE_PROTO = ROOT / "proto/qinglong/admin/v1/admin_service.proto"
CONTROL = ROOT / "services/control/src/qinglong_control"


def test_page_size_zero_means_the_default_the_contract_states() -> None:
    stated = re.findall(r"0 means the default of (\d+)", RUN_SERVICE_PROTO.read_text())
    assert len(stated) == 2, "ListRuns and ListRunEvents each state their default"
    tasks = re.findall(r"0 means the default of (\d+)", TASK_SERVICE_PROTO.read_text())
    assert len(tasks) == 1, "ListTasks states its default"
    admin = re.findall(r"0 means the default of (\d+)", ADMIN_SERVICE_PROTO.read_text())
    assert len(admin) == 4, "ListProjects, ListPrincipals, ListWorkers, ListAuditRecords"
    assert {int(value) for value in stated + tasks + admin} == {bounds.PAGE_SIZE_DEFAULT}
    assert wire.page_size(0) == bounds.PAGE_SIZE_DEFAULT
    assert wire.page_size(1) == 1
    assert wire.page_size(bounds.PAGE_SIZE_MAX) == bounds.PAGE_SIZE_MAX


def test_output_read_size_zero_means_the_default_the_contract_states() -> None:
    stated = re.findall(r"0 reads the default, (\d+) bytes", RUN_SERVICE_PROTO.read_text())
    assert [int(value) for value in stated] == [bounds.OUTPUT_READ_DEFAULT_BYTES]
    assert bounds.OUTPUT_READ_DEFAULT_BYTES <= bounds.OUTPUT_READ_MAX_BYTES


def _response_bound(message: str, field: str) -> str:
    """The `Bound:` comment of ``message.field`` in admin_service.proto."""
    text = ADMIN_SERVICE_PROTO.read_text()
    body = text[text.index(f"message {message} {{") :]
    found = re.search(rf"// Bound: ([^\n]+)\n\s+\S.* {field} = ", body)
    assert found is not None, (message, field)
    return found[1]


def test_administration_constants_are_the_contracts() -> None:
    text = ADMIN_SERVICE_PROTO.read_text()
    assert "absent means one hour" in text
    assert administration.JOIN_TOKEN_TTL_DEFAULT_SECONDS == 60 * 60
    tokens = _response_bound("ListTokensResponse", "tokens")
    assert tokens == f"0..{administration.TOKENS_LISTED_MAX} items."
    bindings = _response_bound("ListRoleBindingsResponse", "bindings")
    assert bindings == f"0..{administration.ROLE_BINDINGS_LISTED_MAX} items."
    for message, field in (
        ("IssueTokenResponse", "token"),
        ("RotateTokenResponse", "token"),
        ("CreateWorkerResponse", "join_token"),
        ("IssueJoinTokenResponse", "join_token"),
    ):
        assert _response_bound(message, field) == "0 or 48 ASCII chars."
    assert len(administration.new_operator_token().plaintext) == 48
    assert len(administration.new_join_token().plaintext) == 48


def _list_runs(page_size: int) -> runtime_service_pb2.ListRunsRequest:
    return runtime_service_pb2.ListRunsRequest(
        request=run_service_pb2.ListRunsRequest(project_id="proj-a", page_size=page_size)
    )


@pytest.mark.parametrize("size", [-1, bounds.PAGE_SIZE_MAX + 1])
def test_a_page_size_out_of_range_is_refused_by_field(size: int) -> None:
    with pytest.raises(Refused) as refused:
        check_public_request(_list_runs(size))
    assert (refused.value.reason, refused.value.field) == (Reason.FIELD_INVALID, "page_size")


@pytest.mark.parametrize("size", [0, bounds.PAGE_SIZE_MAX])
def test_a_page_size_in_range_passes(size: int) -> None:
    check_public_request(_list_runs(size))


def test_every_runtime_method_is_checked_against_the_contract() -> None:
    checked = public_request_types(RUNTIME_SERVICE)
    assert len(checked) == len(RUNTIME_SERVICE.methods)
    assert checked["/qinglong.runtime.v1.RuntimeService/ControlLease"].full_name == (
        "qinglong.worker.v1.ControlLeaseRequest"
    )


@pytest.mark.parametrize(
    "module", ["servicer.py", "wire.py", "admin_servicer.py", "admin_wire.py", "paging.py"]
)
def test_control_writes_no_bound_of_its_own(module: str) -> None:
    """A bound written here would drift from the contract: no numbers, no range checks."""
    text = (CONTROL / module).read_text()
    numbers = {int(n) for n in re.findall(r"(?<![\w.^-])\d+(?![\w.])", text)}
    assert numbers <= {0, 1, 3, 4}, sorted(numbers)
    assert re.findall(r"bounds\.\w*(?:_MIN|_MAX_BYTES|_MAX_CHARS)\b", text) == []


def _largest_offer(index: int) -> PlacedOffer:
    """An offer at the contract's limits: argv of 64 KiB and every parameter at its
    longest (three-byte characters)."""
    argv_item = "a" * (bounds.COMMAND_ARGV_MAX_TOTAL_BYTES // bounds.COMMAND_ARGV_MAX_ITEMS)
    value = "\u6625" * (bounds.RUN_PARAMETER_VALUE_MAX_BYTES // 3)
    names = [
        f"P{n:02d}".ljust(bounds.RUN_PARAMETER_NAME_MAX_LENGTH, "X")
        for n in range(bounds.RUN_PARAMETERS_MAX)
    ]
    return PlacedOffer(
        offer_id=uuid.UUID(int=index + 1),
        run_id=uuid.UUID(int=1000 + index),
        project_id="p" * bounds.SLUG_MAX_LENGTH,
        task_id=uuid.uuid4(),
        revision_id=uuid.uuid4(),
        revision_number=bounds.MAX_SAFE_INTEGER,
        executor_type="remote_worker",
        command=[argv_item] * bounds.COMMAND_ARGV_MAX_ITEMS,
        timeout_ms=bounds.TIMEOUT_MS_MAX,
        parameters=dict.fromkeys(names, value),
        expires_at_ms=2_000,
    )


def test_pull_offers_answers_fewer_offers_rather_than_more_than_a_worker_takes() -> None:
    """64 offers at the contract's limits are about 6.5 MB, past the Worker's 4 MiB
    receive limit: the answer is the oldest that fit, wrapped as control sends it; fewer
    offers all come."""
    placed = [_largest_offer(index) for index in range(bounds.MAX_OFFERS_MAX)]
    answer = wire.pull_offers_response(Offers(placed, now_ms=1_000))
    wrapped = runtime_service_pb2.PullOffersResponse(response=answer)
    assert 1 <= len(answer.offers) < len(placed)
    assert wrapped.ByteSize() <= bounds.WORKER_RESPONSE_MAX_BYTES
    assert [offer.offer_id for offer in answer.offers] == [
        str(offer.offer_id) for offer in placed[: len(answer.offers)]
    ]
    few = wire.pull_offers_response(Offers(placed[:3], now_ms=1_000))
    assert len(few.offers) == 3
    assert bounds.offers_that_fit([]) == 0
    assert bounds.offers_that_fit([2 * bounds.PULL_OFFERS_RESPONSE_MAX_BYTES] * 2) == 1
