"""Administration's pure rules (domain/administration.py) and every list's page token
(paging.py), without a database."""

from __future__ import annotations

import base64
import hashlib
import uuid

import pytest
from qinglong_cli import pki
from qinglong_control import paging
from qinglong_control.domain import administration as adm
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_protocol import bounds, identities

NOW = 1_800_000_000_000
PRINCIPAL = uuid.UUID("6f1c8d3a-2b4e-4f5a-9c7d-8e9f0a1b2c3d")


def token(expires_at_ms: int | None, status: str = "active") -> adm.TokenRow:
    return adm.TokenRow(uuid.uuid4(), PRINCIPAL, "qlo1_abcdef", status, NOW - 1000, expires_at_ms)


def principal(kind: str = "user", status: str = "active") -> adm.PrincipalRow:
    return adm.PrincipalRow(PRINCIPAL, kind, "alice", status, False, NOW)


def test_secrets_have_the_contracts_shape_and_only_their_digest_is_kept() -> None:
    for made, prefix in ((adm.new_operator_token(), "qlo1_"), (adm.new_join_token(), "qlj1_")):
        text = made.plaintext
        assert text.startswith(prefix)
        assert len(text) == 48
        assert len(base64.urlsafe_b64decode(text[5:] + "=")) == 32
        assert made.digest == hashlib.sha256(text.encode()).hexdigest()
        assert bounds.is_sha256_hex(made.digest)
        assert text not in repr(made)
        assert made.digest not in repr(made)
    issued = adm.new_operator_token()
    assert issued.shown_prefix == issued.plaintext[:11]
    assert adm.new_operator_token().plaintext != issued.plaintext


def test_a_replay_answers_with_its_first_row_and_a_taken_key_is_refused() -> None:
    assert adm.replay_or_new(None, None, "x") is None
    assert adm.replay_or_new("first", "first", "x") == "first"
    assert adm.replay_or_new("first", None, "x") == "first"
    with pytest.raises(Refused) as taken:
        adm.replay_or_new(None, "other's", "a project with this id")
    assert taken.value.reason is Reason.ALREADY_EXISTS


def test_who_may_hold_a_token() -> None:
    assert adm.check_token_holder(principal()) == principal()
    assert adm.check_token_holder(principal("agent")).kind == "agent"
    for refused_principal, reason in (
        (None, Reason.PRINCIPAL_NOT_FOUND),
        (principal("worker"), Reason.FIELD_INVALID),
        (principal(status="disabled"), Reason.STATE_CONFLICT),
    ):
        with pytest.raises(Refused) as refused:
            adm.check_token_holder(refused_principal)
        assert refused.value.reason is reason
    with pytest.raises(Refused) as worker:
        adm.check_disable_principal(principal("worker"))
    assert worker.value.field == "principal_id"


def test_rotation_times() -> None:
    lasting = token(NOW + 59_000)  # issued for a minute, a second ago
    assert adm.successor_expiry(lasting, NOW) == NOW + 60_000
    assert adm.successor_expiry(token(None), NOW) is None
    assert adm.overlap_expiry(token(None), NOW, 30) == NOW + 30_000
    assert adm.overlap_expiry(token(None), NOW, 0) == NOW
    assert adm.overlap_expiry(lasting, NOW, 3600) == NOW + 59_000  # never extended
    assert adm.join_token_expiry(NOW, None) == NOW + 3_600_000
    assert adm.join_token_expiry(NOW, 60) == NOW + 60_000
    assert adm.expiry(NOW, None) is None
    with pytest.raises(Refused) as revoked:
        adm.check_rotation(token(None, "revoked"), principal())
    assert revoked.value.reason is Reason.STATE_CONFLICT
    with pytest.raises(Refused) as missing:
        adm.check_rotation(None, principal())
    assert missing.value.field == "token_id"


def test_the_last_active_user_cluster_admin_is_never_disabled() -> None:
    admin = adm.PrincipalRow(PRINCIPAL, "user", "root", "active", True, NOW)
    with pytest.raises(Refused) as last:
        adm.check_not_last_cluster_admin(admin, others_active=False)
    assert (last.value.reason, last.value.field) == (Reason.LAST_CLUSTER_ADMIN, None)
    adm.check_not_last_cluster_admin(admin, others_active=True)
    # Nothing would change: already disabled, or no cluster admin at all.
    adm.check_not_last_cluster_admin(
        adm.PrincipalRow(PRINCIPAL, "user", "root", "disabled", True, NOW), others_active=False
    )
    adm.check_not_last_cluster_admin(principal(), others_active=False)


def test_who_may_be_given_a_join_token() -> None:
    adm.check_join_token_holder("active")
    with pytest.raises(Refused) as disabled:
        adm.check_join_token_holder("disabled")
    assert disabled.value.reason is Reason.WORKER_DISABLED
    with pytest.raises(Refused) as missing:
        adm.check_join_token_holder(None)
    assert (missing.value.reason, missing.value.field) == (Reason.WORKER_NOT_FOUND, "worker_id")


@pytest.mark.parametrize(
    ("status", "remaining", "shown"),
    [
        ("online", 5000, ("online", 5000)),
        ("draining", 1, ("draining", 1)),
        ("online", 0, ("expired", 0)),
        ("expired", 0, ("expired", 0)),
        ("replaced", 9000, ("fenced", 0)),
        ("closed", 0, ("fenced", 0)),
    ],
)
def test_the_fleet_names_a_session_by_db_time(
    status: str, remaining: int, shown: tuple[str, int]
) -> None:
    assert adm.session_state(status, remaining) == shown


@pytest.mark.parametrize(
    ("cursor", "parse"),
    [
        ((NOW, PRINCIPAL), paging.time_and_id),
        ((NOW, "proj-a"), paging.time_and_slug),
        (("worker-a",), paging.after_slug),
    ],
)
def test_every_cursor_shape_round_trips(cursor: tuple[object, ...], parse: object) -> None:
    issued = paging.page_token(cursor)
    assert bounds.PAGE_TOKEN_PATTERN.match(issued)
    parsed = parse(issued)  # type: ignore[operator]
    assert parsed == (cursor[0] if len(cursor) == 1 else cursor)
    assert parse("") is None  # type: ignore[operator]


def _token(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    ("token", "parse"),
    [
        (_token("Worker-A"), paging.after_slug),  # not a slug
        (_token("a:b"), paging.after_slug),  # two parts for one
        (_token(f"{NOW}:Proj"), paging.time_and_slug),
        (_token(f"{NOW}"), paging.time_and_slug),
        (_token("-1:proj-a"), paging.time_and_slug),
        (_token(f"{NOW}:{PRINCIPAL}"), paging.after_slug),
        (_token("proj-a"), paging.time_and_id),
    ],
)
def test_a_cursor_of_another_shape_is_refused_by_field(token: str, parse: object) -> None:
    with pytest.raises(Refused) as refused:
        parse(token)  # type: ignore[operator]
    assert (refused.value.reason, refused.value.field) == (Reason.FIELD_INVALID, "page_token")


def test_one_spelling_of_identity_uris_for_every_package() -> None:
    """The dev PKI issues the SAN URI control records for a new Worker: it spells it
    with the one definition, not a copy."""
    assert identities.worker_uri("t.example", "w-1") == "spiffe://t.example/worker/w-1"
    assert pki.worker_uri is identities.worker_uri
    assert pki.DEFAULT_TRUST_DOMAIN is identities.DEFAULT_TRUST_DOMAIN
