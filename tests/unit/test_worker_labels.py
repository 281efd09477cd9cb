"""A Worker's labels from its flags or environment, checked before it opens a session,
and sent with OpenSession and every RenewSession."""

from __future__ import annotations

from typing import Any, Final

import pytest
from qinglong.worker.v1 import worker_pb2
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong_protocol import bounds
from qinglong_worker.inbox import Inbox
from qinglong_worker.session import SessionKeeper
from qinglong_worker.settings import parse_worker_settings

_CONNECTION: Final = (
    "run",
    "--worker-id",
    "w",
    "--ingress-address",
    "127.0.0.1:1",
    "--tls-ca",
    "ca",
    "--tls-cert",
    "cert",
    "--tls-key",
    "key",
    "--inbox",
    "/nonexistent/inbox.db",
)


def _labels(argv: list[str], environ: dict[str, str] | None = None) -> dict[str, str]:
    daemon = parse_worker_settings([*_CONNECTION, *argv], environ or {})[1].daemon
    assert daemon is not None
    return dict(daemon.labels)


def test_labels_come_from_the_flags_or_else_the_environment() -> None:
    assert _labels([]) == {}
    flags = ["--label", "gpu=a100", "--label", "note=a=b c"]
    assert _labels(flags) == {"gpu": "a100", "note": "a=b c"}
    environ = {"QINGLONG_WORKER_LABELS": "gpu=t4,zone=eu-1,"}
    assert _labels([], environ) == {"gpu": "t4", "zone": "eu-1"}
    # Flags given: the environment's list is not merged in.
    assert _labels(["--label", "os=linux"], environ) == {"os": "linux"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--label", "gpu"], "needs KEY=VALUE"),
        (["--label", "gpu=a", "--label", "gpu=b"], "gpu: given twice"),
        (["--label", "Gpu=a"], "label key 'Gpu' must be"),
        (["--label", "gpu=" + "v" * (bounds.WORKER_LABEL_VALUE_MAX_BYTES + 1)], "at most 63"),
        (["--label", "gpu=a\x1b[31m"], "without control characters"),
        (["--label", "gpu=\udcff"], "must be UTF-8 text"),  # argv bytes not UTF-8
        (
            [f"--label=k{n:02d}=v" for n in range(bounds.WORKER_LABELS_MAX + 1)],
            f"at most {bounds.WORKER_LABELS_MAX} labels",
        ),
    ],
)
def test_a_label_the_contract_refuses_stops_the_daemon_before_it_starts(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        parse_worker_settings([*_CONNECTION, *flags], {})
    assert refused.value.code == 2
    assert message in capsys.readouterr().err


class _RecordingClient:
    """Answers OpenSession and RenewSession, keeping what they asked."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def open_session(self, request: ws.OpenSessionRequest, **_: Any) -> Any:
        self.sent.append(request)
        answer = ws.OpenSessionResponse(
            session_id="00000000-0000-4000-8000-000000000001",
            worker_generation=1,
            session_state=worker_pb2.SESSION_STATE_ONLINE,
        )
        answer.session_remaining.FromMilliseconds(30_000)
        answer.renew_interval.FromMilliseconds(10_000)
        return answer

    async def renew_session(self, request: ws.RenewSessionRequest, **_: Any) -> Any:
        self.sent.append(request)
        answer = ws.RenewSessionResponse(session_state=worker_pb2.SESSION_STATE_ONLINE)
        answer.session_remaining.FromMilliseconds(30_000)
        return answer


async def test_the_labels_and_capacity_go_with_the_open_and_every_renewal(
    tmp_path: Any,
) -> None:
    """A restarted Worker resumes the session in its inbox by renewing it: the renewal
    must carry the labels and capacity it runs with now, not those it opened with."""
    inbox = Inbox.open(tmp_path / "inbox.db")
    client = _RecordingClient()
    now = [0.0]

    def keeper(labels: dict[str, str], max_concurrency: int) -> SessionKeeper:
        return SessionKeeper(
            inbox=inbox,
            client=client,  # type: ignore[arg-type]
            worker_id="w",
            max_concurrency=max_concurrency,
            labels=labels,
            clock=lambda: now[0],
        )

    assert await keeper({"gpu": "a100"}, 2).ensure() is not None
    restarted = keeper({"gpu": "t4", "zone": "eu"}, 6)
    assert await restarted.ensure() is not None
    opened, renewed = client.sent
    assert isinstance(opened, ws.OpenSessionRequest)
    assert dict(opened.labels) == {"gpu": "a100"}
    assert opened.max_concurrent_attempts == 2
    assert isinstance(renewed, ws.RenewSessionRequest)
    assert dict(renewed.labels) == {"gpu": "t4", "zone": "eu"}
    assert renewed.max_concurrent_attempts == 6
    inbox.close()
