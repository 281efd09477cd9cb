"""The CLI's creates without a server: retry settings are never dropped unseen, and a
lost answer says what to do — send the request id again, or, for a secret the repeat
cannot show, replace it."""

from __future__ import annotations

import io

import grpc
import pytest
from qinglong_cli.cli_errors import (
    EXIT_UNAVAILABLE,
    ConfigurationError,
    UnknownOutcome,
    report_unknown_outcome,
    sent_once,
)
from qinglong_cli.main import _parser
from qinglong_cli.operator import _plan


def _parsed(*flags: str) -> object:
    return _parser().parse_args(["task", "create", "--name", "t", *flags, "--", "false"])


@pytest.mark.parametrize(
    "flags",
    [
        ("--retry-on", "failed"),
        ("--retry-backoff-ms", "0"),
        ("--retry-multiplier-percent", "0"),
        ("--retry-max-backoff-ms", "5000"),
    ],
)
def test_retry_settings_without_max_attempts_are_refused(flags: tuple[str, ...]) -> None:
    with pytest.raises(ConfigurationError, match=f"^{flags[0]} needs --max-attempts$"):
        _plan(_parsed(*flags))  # type: ignore[arg-type]


def test_zero_delays_with_max_attempts_are_kept() -> None:
    plan = _plan(_parsed("--max-attempts", "3", "--retry-backoff-ms", "0"))  # type: ignore[arg-type]
    assert plan.retry_policy.max_attempts == 3
    assert plan.retry_policy.initial_backoff_ms == 0
    assert not _plan(_parsed()).HasField("retry_policy")  # type: ignore[arg-type]


async def _lost(secret_hint: str | None = None) -> str:
    async def unanswered() -> None:
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata()
        )

    with pytest.raises(UnknownOutcome) as unknown:
        await sent_once(unanswered(), "req-7", secret_hint=secret_hint)
    err = io.StringIO()
    assert report_unknown_outcome(unknown.value, err) == EXIT_UNAVAILABLE
    return err.getvalue()


async def test_a_lost_answer_names_the_request_id_to_send_again() -> None:
    said = await _lost()
    assert said.startswith("error: DEADLINE_EXCEEDED")
    assert "--request-id req-7 answers what it did" in said


async def test_a_lost_secret_is_replaced_not_asked_for_again() -> None:
    said = await _lost(secret_hint="issue another")
    assert "shown only in the answer that was lost: issue another" in said
    assert "--request-id" not in said, "a repeat would answer without the secret"
