"""The one storage-error rule (qinglong_protocol.storage_errors), and that ingress and
control both answer by it.

The errors are psycopg's own classes (each carries its real SQLSTATE); what a caller of
the running services sees is proven on the real stack in
tests/integration/test_ingress_gateway.py and tests/integration/test_error_model.py.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import psycopg
import psycopg_pool
import pytest
from psycopg import errors as pg
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong.runtime.v1 import runtime_service_pb2
from qinglong.worker.v1 import worker_service_pb2
from qinglong_control.errors import answer_for
from qinglong_ingress.gateway import _storage_refusal
from qinglong_ingress.routes import ROUTES
from qinglong_protocol.storage_errors import StorageFailure, Verdict, classify, storage_answer

ROOT = Path(__file__).resolve().parents[2]
_E = ErrorReason


@pytest.mark.parametrize(
    ("sqlstate", "operational", "verdict"),
    [
        ("08006", True, Verdict.UNAVAILABLE),  # connection failure
        ("08001", True, Verdict.UNAVAILABLE),
        ("40001", True, Verdict.UNAVAILABLE),  # serialization failure
        ("40P01", True, Verdict.UNAVAILABLE),  # deadlock detected
        ("53300", True, Verdict.UNAVAILABLE),  # too many connections
        ("57014", True, Verdict.UNAVAILABLE),  # query canceled (statement_timeout)
        ("57P01", True, Verdict.UNAVAILABLE),  # admin shutdown
        ("57P03", True, Verdict.UNAVAILABLE),  # cannot connect now (starting up)
        ("58030", True, Verdict.UNAVAILABLE),  # I/O error
        ("55P03", True, Verdict.UNAVAILABLE),  # lock not available
        ("25006", False, Verdict.UNAVAILABLE),  # read-only transaction: a read-only server
        (None, True, Verdict.UNAVAILABLE),  # refused/lost connection, pool timeout
        ("23514", False, Verdict.CONSTRAINT),
        ("23505", False, Verdict.CONSTRAINT),
        ("23503", False, Verdict.CONSTRAINT),
        ("22003", False, Verdict.DATA),  # numeric value out of range
        ("22021", False, Verdict.DATA),  # character not in repertoire
        ("42501", False, Verdict.INTERNAL),  # insufficient privilege: a deployment fault
        ("42P01", False, Verdict.INTERNAL),  # undefined table
        ("54000", True, Verdict.INTERNAL),  # program limit exceeded: retrying cannot help
        ("55000", True, Verdict.INTERNAL),
        ("28P01", True, Verdict.INTERNAL),  # wrong password: configuration
        ("XX000", False, Verdict.INTERNAL),
        ("25P02", False, Verdict.INTERNAL),  # in failed transaction: our bug
        (None, False, Verdict.INTERNAL),  # the driver's own misuse (InterfaceError)
    ],
)
def test_the_rule_goes_by_sqlstate_class(
    sqlstate: str | None, operational: bool, verdict: Verdict
) -> None:
    assert classify(sqlstate, operational=operational) is verdict


def _failure(error: psycopg.Error) -> StorageFailure:
    return StorageFailure(
        error.sqlstate,
        error.diag.constraint_name,
        operational=isinstance(error, psycopg.OperationalError),
        error_type=type(error).__name__,
    )


def test_the_drivers_own_transient_failures_are_unavailable() -> None:
    for error in (
        psycopg_pool.PoolTimeout("couldn't get a connection after 1.60 sec"),
        psycopg.OperationalError("connection to server at 10.0.0.7 failed: refused"),
    ):
        assert _failure(error).verdict is Verdict.UNAVAILABLE
    assert _failure(psycopg.InterfaceError("the cursor is closed")).verdict is Verdict.INTERNAL


def test_answers_never_carry_the_driver_message() -> None:
    name = "qinglong.worker.v1.OpenSessionRequest"
    unavailable = storage_answer(StorageFailure("57P01", operational=True), request_name=name)
    assert (unavailable.reason, unavailable.message) == (
        _E.ERROR_REASON_STORAGE_UNAVAILABLE,
        "storage unavailable",
    )
    audit = storage_answer(
        StorageFailure(None, operational=True),
        request_name=name,
        unavailable=_E.ERROR_REASON_AUDIT_UNAVAILABLE,
    )
    assert audit.reason == _E.ERROR_REASON_AUDIT_UNAVAILABLE
    data = storage_answer(StorageFailure("22003"), request_name=name)
    assert data.reason == _E.ERROR_REASON_FIELD_INVALID
    assert [field for field, _ in data.field_violations] == [name]
    unmapped = storage_answer(StorageFailure("23514", "some_check"), request_name=name)
    assert unmapped.reason == _E.ERROR_REASON_INTERNAL
    internal = storage_answer(StorageFailure("42501"), request_name=name)
    assert (internal.reason, internal.message, internal.field_violations) == (
        _E.ERROR_REASON_INTERNAL,
        "internal error",
        (),
    )


def _every_psycopg_error() -> list[type[psycopg.Error]]:
    found = [
        value
        for value in vars(pg).values()
        if isinstance(value, type) and issubclass(value, psycopg.Error) and value.sqlstate
    ]
    return sorted(found, key=lambda kind: kind.sqlstate or "")


class _Diag:
    constraint_name = "a_constraint_only_the_database_knows"


def _raised(kind: type[psycopg.Error]) -> psycopg.Error:
    """An instance of ``kind`` (its class carries the SQLSTATE), naming a constraint
    neither service maps, with a message that must never reach a caller."""

    class Raised(kind):  # type: ignore[misc, valid-type]
        @property
        def diag(self) -> Any:
            return _Diag()

    return Raised("secret-value in a driver message")


def test_ingress_and_control_answer_every_sqlstate_alike() -> None:
    """One rule, two services: for every SQLSTATE psycopg knows (and its pool timeout),
    control's interceptor and ingress's admission give the same reason and fields."""
    route = next(r for r in ROUTES if r.name == "OpenSession")
    request = runtime_service_pb2.OpenSessionRequest(
        request=worker_service_pb2.OpenSessionRequest()
    )
    kinds: list[Any] = [*_every_psycopg_error(), psycopg_pool.PoolTimeout]
    assert len(kinds) > 200
    seen = set()
    for kind in kinds:
        error = _raised(kind)
        control = answer_for(error, request)
        ingress = _storage_refusal(error, route).answer
        assert (control.reason, control.field_violations) == (
            ingress.reason,
            ingress.field_violations,
        ), kind.__name__
        assert "secret" not in control.message + ingress.message
        seen.add(control.reason)
    assert seen == {
        _E.ERROR_REASON_STORAGE_UNAVAILABLE,
        _E.ERROR_REASON_FIELD_INVALID,
        _E.ERROR_REASON_INTERNAL,
    }


#: The protocol modules of the `database` extra: only the services install and import them.
_DATABASE_EXTRA_MODULES = {"pooling.py", "schema_version.py"}


def _imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


def test_the_protocol_package_stays_free_of_the_driver_and_of_servers() -> None:
    """Workers install qinglong_protocol: no psycopg outside the services' `database`
    extra (which no Worker module imports), and no grpc server in it."""
    for path in (ROOT / "proto/qinglong_protocol").rglob("*.py"):
        names = _imported_modules(path)
        uses_driver = any(n.split(".")[0] in {"psycopg", "psycopg_pool"} for n in names)
        assert uses_driver == (path.name in _DATABASE_EXTRA_MODULES), path
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute):
                assert node.attr not in {"server", "add_generic_rpc_handlers"}, path
    extra = {f"qinglong_protocol.{name.removesuffix('.py')}" for name in _DATABASE_EXTRA_MODULES}
    for path in (ROOT / "clients").rglob("*.py"):
        if ".venv" not in path.parts:
            assert not extra & set(_imported_modules(path)), path
