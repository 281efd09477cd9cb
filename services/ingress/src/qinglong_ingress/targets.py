"""The ids a request names, read only where they are well formed, for binding and audit."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from google.protobuf.message import Message
from qinglong_protocol import bounds


@dataclass(frozen=True)
class Targets:
    worker_id: str | None = None
    session_id: uuid.UUID | None = None
    project_id: str | None = None
    run_id: uuid.UUID | None = None
    request_id: str | None = None


def _field(message: Message, name: str) -> str:
    if name not in message.DESCRIPTOR.fields_by_name:
        return ""
    value = getattr(message, name)
    return value if isinstance(value, str) else ""


def targets_of(request: Message) -> Targets:
    """Worker requests name their ids directly or in their fence; operator requests name
    the project (and run). Malformed values are left out: they are the validator's to
    refuse, and an audit row must never carry an unbounded or secret string."""
    source = request
    if "fence" in request.DESCRIPTOR.fields_by_name:
        source = getattr(request, "fence")  # noqa: B009 - a protobuf field, not an attribute guess
    worker_id = _field(source, "worker_id")
    session_id = _field(source, "session_id")
    project_id = _field(source, "project_id") or _field(request, "project_id")
    run_id = _field(source, "run_id") or _field(request, "run_id")
    request_id = _field(request, "request_id") or _field(request, "mutation_id")
    return Targets(
        worker_id=worker_id if bounds.is_slug(worker_id) else None,
        session_id=uuid.UUID(session_id) if bounds.is_uuid(session_id) else None,
        project_id=project_id if bounds.is_slug(project_id) else None,
        run_id=uuid.UUID(run_id) if bounds.is_uuid(run_id) else None,
        request_id=request_id if bounds.is_request_id(request_id) else None,
    )
