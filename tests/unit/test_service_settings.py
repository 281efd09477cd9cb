"""Settings of control and ingress that bound waiting (R-ERR-2) and durable promises."""

from __future__ import annotations

import pytest
from qinglong_control.settings import parse_control_settings
from qinglong_ingress.settings import parse_ingress_settings
from qinglong_protocol.storage import DEFAULT_STORAGE_TIMEOUT_SECONDS, StorageBounds

TLS = ["--tls-ca", "ca.pem", "--tls-cert", "cert.pem", "--tls-key", "key.pem"]
INGRESS_TLS = [
    *TLS,
    *("--control-address", "127.0.0.1:1", "--control-tls-cert", "c.pem"),
    *("--control-tls-key", "k.pem"),
]


def test_storage_timeout_defaults_to_two_seconds_and_bounds_every_wait() -> None:
    settings = parse_control_settings(TLS, environ={})
    assert settings.storage.timeout_seconds == DEFAULT_STORAGE_TIMEOUT_SECONDS == 2.0
    bounds = settings.storage
    assert bounds.acquire_timeout_seconds < bounds.timeout_seconds
    kwargs = bounds.connection_kwargs("qinglong-control")
    assert kwargs["connect_timeout"] == 2
    assert kwargs["autocommit"] is True
    assert kwargs["options"] == "-c statement_timeout=10000 -c synchronous_commit=on"


def test_storage_timeout_comes_from_flag_or_environment() -> None:
    from_env = parse_control_settings(TLS, environ={"QINGLONG_STORAGE_TIMEOUT_SECONDS": "0.5"})
    assert from_env.storage == StorageBounds(0.5)
    flag = parse_control_settings(
        [*TLS, "--storage-timeout-seconds", "3"],
        environ={"QINGLONG_STORAGE_TIMEOUT_SECONDS": "0.5"},
    )
    assert flag.storage.timeout_seconds == 3.0
    assert flag.storage.connection_kwargs("x")["connect_timeout"] == 3


def test_a_nonsensical_storage_timeout_is_a_usage_error() -> None:
    for value in ("0", "-1", "1e9"):
        with pytest.raises(SystemExit):
            parse_control_settings([*TLS, "--storage-timeout-seconds", value], environ={})


def test_control_timings_from_flags_and_environment() -> None:
    settings = parse_control_settings(
        [*TLS, "--lease-ttl-ms", "4000"], environ={"QINGLONG_CONTROL_OFFER_TTL_MS": "2000"}
    )
    assert (settings.timings.lease_ttl_ms, settings.timings.offer_ttl_ms) == (4000, 2000)
    assert settings.timings.session_ttl_ms == 30_000
    with pytest.raises(SystemExit):
        parse_control_settings([*TLS, "--lease-ttl-ms", "10"], environ={})


def test_ingress_takes_the_same_storage_bound() -> None:
    settings = parse_ingress_settings(
        INGRESS_TLS, environ={"QINGLONG_STORAGE_TIMEOUT_SECONDS": "1.5"}
    )
    assert settings.storage == StorageBounds(1.5)


def test_control_admin_database_and_trust_domain() -> None:
    """The admin role's URL (optional: without it AdminService answers UNAVAILABLE) and
    the trust domain new Workers' SAN URIs are formed in, from flag or environment."""
    plain = parse_control_settings(TLS, environ={})
    assert (plain.admin_database_url, plain.trust_domain) == (None, "qinglong.local")
    url = "postgresql://qinglong_admin:s3cret@db/qinglong"
    from_env = parse_control_settings(
        TLS,
        environ={
            "QINGLONG_CONTROL_ADMIN_DATABASE_URL": url,
            "QINGLONG_CONTROL_TRUST_DOMAIN": "example.org",
        },
    )
    assert (from_env.admin_database_url, from_env.trust_domain) == (url, "example.org")
    assert "s3cret" not in repr(from_env)
    flag = parse_control_settings(
        [*TLS, "--admin-database-url", "postgresql:///x", "--trust-domain", "corp.example"],
        environ={"QINGLONG_CONTROL_ADMIN_DATABASE_URL": url},
    )
    assert (flag.admin_database_url, flag.trust_domain) == ("postgresql:///x", "corp.example")


@pytest.mark.parametrize("service", ["control", "ingress"])
def test_pool_size_from_environment_and_a_bad_one_is_a_usage_error(
    service: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parse = parse_control_settings if service == "control" else parse_ingress_settings
    argv = TLS if service == "control" else INGRESS_TLS
    assert parse(argv, environ={"QINGLONG_POOL_MAX_SIZE": "12"}).pool.max_size == 12
    for value in ("abc", "-3"):  # not a number; out of 1..1000
        with pytest.raises(SystemExit) as usage:
            parse(argv, environ={"QINGLONG_POOL_MAX_SIZE": value})
        assert usage.value.code == 2
        assert "--pool-max-size" in capsys.readouterr().err
    # A set approval lifetime (R-OPS-2) is read like the other timings, and bounded.
    if service == "control":
        env = {"QINGLONG_CONTROL_APPROVAL_TTL_MS": "60000"}
        assert parse_control_settings(TLS, environ=env).timings.approval_ttl_ms == 60_000
        with pytest.raises(SystemExit):
            parse_control_settings([*TLS, "--approval-ttl-ms", str(31 * 86_400_000)], environ={})


def test_audit_retention_in_days_from_flag_or_environment_never_below_the_floor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    day_ms = 24 * 3600 * 1000
    assert parse_control_settings(TLS, {}).audit_retention.max_age_ms == 90 * day_ms
    env = {"QINGLONG_CONTROL_AUDIT_RETENTION_DAYS": "30"}
    assert parse_control_settings(TLS, env).audit_retention.max_age_ms == 30 * day_ms
    flagged = parse_control_settings([*TLS, "--audit-retention-days", "400"], env)
    assert flagged.audit_retention.max_age_ms == 400 * day_ms
    with pytest.raises(SystemExit) as usage:
        parse_control_settings([*TLS, "--audit-retention-days", "6"], {})
    assert usage.value.code == 2
    assert "at least 7 days" in capsys.readouterr().err
