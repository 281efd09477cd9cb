"""Where a `qinglong` command that calls ingress gets its address, TLS files, token file and
project: flags over environment variables over the stack file, all four connection
settings or none, and every missing setting or unreadable file named."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path

import grpc
import pytest
from qinglong_cli import main as cli_main
from qinglong_cli.cli_errors import EXIT_USAGE, ConfigurationError
from qinglong_cli.ingress_client import (
    ADMIN_TOKEN,
    OPERATOR_TOKEN,
    ConnectionArguments,
    OperatorContext,
    TokenSource,
    add_connection_flags,
    add_operator_flags,
)
from qinglong_cli.pki import ensure_dev_pki, ensure_operator_identity
from qinglong_protocol.tls import TlsFiles

#: Every variable the resolution reads: a test's environment is exactly what it says.
_VARIABLES = (
    "QINGLONG_ADDRESS",
    "QINGLONG_CA_CERT",
    "QINGLONG_CERT",
    "QINGLONG_KEY",
    "QINGLONG_PROJECT",
    "QINGLONG_TOKEN_FILE",
    "QINGLONG_ADMIN_TOKEN_FILE",
    "QINGLONG_STACK",
)


@pytest.fixture
def stack_file(tmp_path: Path) -> Path:
    """A stack file as `qinglong up` writes it (its files need not exist to be resolved)."""
    path = tmp_path / "stack.json"
    path.write_text(
        json.dumps(
            {
                "ingress": {"address": "127.0.0.1:7000"},
                "ca_cert": "/stack/ca.crt",
                "project_id": "stack-project",
                "operator": {
                    "cert": "/stack/op.crt",
                    "key": "/stack/op.key",
                    "token_file": "/stack/op.token",
                },
                "admin": {"name": "admin", "token_file": "/stack/admin.token"},
            }
        )
    )
    return path


def _resolve(
    default_stack: Path,
    *argv: str,
    environ: Mapping[str, str] | None = None,
    source: TokenSource = OPERATOR_TOKEN,
) -> OperatorContext:
    """Parse `argv` with the commands' own connection flags, then resolve."""
    parser = argparse.ArgumentParser()
    if source is OPERATOR_TOKEN:
        add_operator_flags(parser, default_stack)
    else:
        add_connection_flags(parser, default_stack, source)
    return OperatorContext.resolve(
        ConnectionArguments.of(parser.parse_args(argv)),
        source,
        environ or {},
        needs_project=source is OPERATOR_TOKEN,
    )


def _refusal(
    default_stack: Path,
    *argv: str,
    environ: Mapping[str, str] | None = None,
    source: TokenSource = OPERATOR_TOKEN,
) -> str:
    with pytest.raises(ConfigurationError) as refused:
        _resolve(default_stack, *argv, environ=environ, source=source)
    return str(refused.value)


_ALL_FLAGS = (
    "--address",
    "ingress.example.com:443",
    "--ca-cert",
    "/flag/ca.crt",
    "--cert",
    "/flag/me.crt",
    "--key",
    "/flag/me.key",
    "--token-file",
    "/flag/me.token",
    "--project",
    "flag-project",
)
_ALL_ENVIRONMENT = {
    "QINGLONG_ADDRESS": "env.example.com:7443",
    "QINGLONG_CA_CERT": "/env/ca.crt",
    "QINGLONG_CERT": "/env/me.crt",
    "QINGLONG_KEY": "/env/me.key",
    "QINGLONG_TOKEN_FILE": "/env/me.token",
    "QINGLONG_PROJECT": "env-project",
}


def test_nothing_explicit_reads_the_stack_file_as_before(stack_file: Path) -> None:
    context = _resolve(stack_file)
    assert context == OperatorContext(
        address="127.0.0.1:7000",
        tls=TlsFiles(Path("/stack/ca.crt"), Path("/stack/op.crt"), Path("/stack/op.key")),
        token_file=Path("/stack/op.token"),
        project_id="stack-project",
        stack_file=stack_file,
    )
    admin = _resolve(stack_file, source=ADMIN_TOKEN)
    assert admin.token_file == Path("/stack/admin.token")


def test_explicit_flags_need_no_stack_file(tmp_path: Path) -> None:
    context = _resolve(tmp_path / "absent.json", *_ALL_FLAGS)
    assert context == OperatorContext(
        address="ingress.example.com:443",
        tls=TlsFiles(Path("/flag/ca.crt"), Path("/flag/me.crt"), Path("/flag/me.key")),
        token_file=Path("/flag/me.token"),
        project_id="flag-project",
        stack_file=None,
    )


def test_the_environment_wins_over_the_stack_file_as_a_whole(stack_file: Path) -> None:
    context = _resolve(stack_file, environ=_ALL_ENVIRONMENT)
    assert context == OperatorContext(
        address="env.example.com:7443",
        tls=TlsFiles(Path("/env/ca.crt"), Path("/env/me.crt"), Path("/env/me.key")),
        token_file=Path("/env/me.token"),
        project_id="env-project",
        stack_file=None,
    )


def test_flags_win_over_the_environment_one_by_one(stack_file: Path) -> None:
    flags = ("--address", "flag.example.com:1", "--key", "/flag/me.key")
    context = _resolve(stack_file, *flags, environ=_ALL_ENVIRONMENT)
    assert context.address == "flag.example.com:1"
    assert context.tls == TlsFiles(Path("/env/ca.crt"), Path("/env/me.crt"), Path("/flag/me.key"))
    assert context.token_file == Path("/env/me.token")
    assert context.project_id == "env-project"
    flagged = _resolve(stack_file, *_ALL_FLAGS, environ=_ALL_ENVIRONMENT)
    assert flagged.token_file == Path("/flag/me.token")
    assert flagged.project_id == "flag-project"


def test_with_a_stack_file_token_and_project_still_follow_flags_then_environment(
    stack_file: Path,
) -> None:
    environ = {"QINGLONG_TOKEN_FILE": "/env/me.token", "QINGLONG_PROJECT": "env-project"}
    from_environment = _resolve(stack_file, environ=environ)
    assert (from_environment.token_file, from_environment.project_id) == (
        Path("/env/me.token"),
        "env-project",
    )
    assert from_environment.address == "127.0.0.1:7000"
    flagged = _resolve(stack_file, "--token-file", "/f.token", "--project", "p", environ=environ)
    assert (flagged.token_file, flagged.project_id) == (Path("/f.token"), "p")


def test_partial_flags_are_refused_naming_what_is_missing(stack_file: Path) -> None:
    # The stack file has every value, yet none of them fills the gap.
    message = _refusal(stack_file, "--address", "ingress.example.com:443", "--cert", "/me.crt")
    assert message.startswith("incomplete connection settings: --address, --cert given")
    assert "the CA certificate (--ca-cert or $QINGLONG_CA_CERT)" in message
    assert "the client key (--key or $QINGLONG_KEY)" in message
    assert "the operator token file (--token-file or $QINGLONG_TOKEN_FILE)" in message
    assert "the project (--project or $QINGLONG_PROJECT)" in message
    assert "the client certificate" not in message
    assert "/stack/" not in message


def test_partial_environment_is_refused_naming_the_variable_that_was_set(
    stack_file: Path,
) -> None:
    environ = {**_ALL_ENVIRONMENT}
    del environ["QINGLONG_CA_CERT"]
    message = _refusal(stack_file, environ=environ)
    assert "$QINGLONG_ADDRESS, $QINGLONG_CERT, $QINGLONG_KEY given" in message
    assert "but not the CA certificate (--ca-cert or $QINGLONG_CA_CERT)." in message
    # An empty variable is unset.
    message = _refusal(stack_file, environ={**_ALL_ENVIRONMENT, "QINGLONG_KEY": ""})
    assert "but not the client key (--key or $QINGLONG_KEY)." in message


def test_a_token_file_is_required_with_explicit_settings(stack_file: Path) -> None:
    flags = _ALL_FLAGS[:8]  # the four connection settings, no token file, no project
    message = _refusal(stack_file, *flags, "--project", "p")
    assert message.endswith(
        "but not the operator token file (--token-file or $QINGLONG_TOKEN_FILE). Give "
        "--address, --ca-cert, --cert, --key and the token file (flags or environment) "
        "together, or none of the four to use the stack file"
    )
    # A cluster admin's command reads its own variable, not the operator's, and needs no
    # project.
    operator_token = {"QINGLONG_TOKEN_FILE": "/env/me.token"}
    admin_message = _refusal(stack_file, *flags, source=ADMIN_TOKEN, environ=operator_token)
    assert "the admin token file (--token-file or $QINGLONG_ADMIN_TOKEN_FILE)" in admin_message
    admin_token = {"QINGLONG_ADMIN_TOKEN_FILE": "/env/admin.token"}
    admin = _resolve(stack_file, *flags, source=ADMIN_TOKEN, environ=admin_token)
    assert (admin.token_file, admin.project_id) == (Path("/env/admin.token"), None)


def test_an_explicit_stack_flag(stack_file: Path) -> None:
    # It wins over the connection's environment variables (a flag over the environment)…
    default = stack_file.parent / "absent.json"
    context = _resolve(default, "--stack", str(stack_file), environ=_ALL_ENVIRONMENT)
    assert (context.address, context.stack_file) == ("127.0.0.1:7000", stack_file)
    assert context.tls.cert == Path("/stack/op.crt")
    assert (context.token_file, context.project_id) == (Path("/env/me.token"), "env-project")
    # …but is never combined with the connection flags.
    message = _refusal(default, "--stack", str(stack_file), "--address", "h:1", "--key", "/k")
    assert message.startswith("--stack cannot be combined with --address, --key")


def test_the_stack_variable_moves_the_default_only(stack_file: Path) -> None:
    """$QINGLONG_STACK stands in for the default stack file: an explicit --stack wins over
    it, and any of the four connection settings still means explicit settings."""
    default = stack_file.parent / "absent.json"
    moved = {"QINGLONG_STACK": str(stack_file)}
    context = _resolve(default, environ=moved)
    assert (context.address, context.stack_file) == ("127.0.0.1:7000", stack_file)
    other = stack_file.parent / "other.json"
    other.write_text(stack_file.read_text().replace("127.0.0.1:7000", "127.0.0.1:7001"))
    assert _resolve(default, "--stack", str(other), environ=moved).address == "127.0.0.1:7001"
    explicit = _resolve(default, environ={**moved, **_ALL_ENVIRONMENT})
    assert (explicit.address, explicit.stack_file) == ("env.example.com:7443", None)
    assert f"no stack file at {default}" in _refusal(default, environ={"QINGLONG_STACK": ""})


def test_a_missing_stack_file_is_named_with_the_way_around_it(tmp_path: Path) -> None:
    message = _refusal(tmp_path / "nowhere.json")
    assert f"no stack file at {tmp_path / 'nowhere.json'}" in message
    assert "--address, --ca-cert, --cert and --key" in message


@pytest.mark.parametrize("address", ["ingress.example.com", ":443", "host:0", "host:http"])
def test_an_address_without_a_port_is_refused(stack_file: Path, address: str) -> None:
    flags = list(_ALL_FLAGS)
    flags[1] = address
    message = _refusal(stack_file, *flags)
    assert message == (
        f"--address or $QINGLONG_ADDRESS must be HOST:PORT (e.g. ingress.example.com:7443): "
        f"{address!r}"
    )


def test_real_certificates_build_credentials_and_a_missing_file_is_named(
    tmp_path: Path,
) -> None:
    pki = ensure_dev_pki(tmp_path / "pki")
    me = ensure_operator_identity(pki, "dora")
    explicit = OperatorContext(
        address="[::1]:7443", tls=me, token_file=tmp_path / "t", project_id="p"
    )
    assert isinstance(explicit.channel_credentials(), grpc.ChannelCredentials)

    gone = tmp_path / "gone.key"
    without_key = OperatorContext(
        address="[::1]:7443",
        tls=TlsFiles(me.ca_cert, me.cert, gone),
        token_file=tmp_path / "t",
        project_id="p",
    )
    with pytest.raises(ConfigurationError) as refused:
        without_key.channel_credentials()
    assert str(refused.value) == (
        f"cannot read the client key {gone} (--key or $QINGLONG_KEY): No such file or directory"
    )
    from_stack = OperatorContext(
        address="[::1]:7443",
        tls=TlsFiles(tmp_path / "no-ca.crt", me.cert, me.key),
        token_file=tmp_path / "t",
        project_id="p",
        stack_file=tmp_path / "stack.json",
    )
    with pytest.raises(ConfigurationError) as refused:
        from_stack.channel_credentials()
    assert str(refused.value) == (
        f"cannot read the CA certificate {tmp_path / 'no-ca.crt'} (named in stack file "
        f"{tmp_path / 'stack.json'}): No such file or directory"
    )
    with pytest.raises(ConfigurationError, match=f"cannot read the token file {tmp_path / 't'}"):
        explicit.metadata()


def test_the_command_line_reports_partial_settings_as_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real `qinglong` entry point: exit 2, stdout empty, the message on stderr."""
    for variable in _VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("QINGLONG_CERT", str(tmp_path / "me.crt"))
    secret = "qlo1_never-printed"
    token_file = tmp_path / "me.token"
    token_file.write_text(secret)
    code = cli_main.main(
        ["run", "list", "--address", "ingress.example.com:443", "--token-file", str(token_file)]
    )
    out, err = capsys.readouterr()
    assert (code, out) == (EXIT_USAGE, "")
    assert err == (
        "error: incomplete connection settings: --address, $QINGLONG_CERT given, but not the "
        "CA certificate (--ca-cert or $QINGLONG_CA_CERT); the client key (--key or "
        "$QINGLONG_KEY); the project (--project or $QINGLONG_PROJECT). Give --address, "
        "--ca-cert, --cert, --key and the token file (flags or environment) together, or "
        "none of the four to use the stack file\n"
    )
    assert secret not in err


def test_every_command_through_ingress_takes_the_connection_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in (
        ["task", "list"],
        ["run", "list"],
        ["approval", "list"],
        ["admin", "project", "list"],
        ["worker", "list"],
    ):
        with pytest.raises(SystemExit):
            cli_main.main([*command, "--help"])
        text = capsys.readouterr().out
        for flag in ("--address", "--ca-cert", "--cert", "--key", "--token-file", "--stack"):
            assert flag in text, (command, flag)
        assert ("$QINGLONG_PROJECT" in text) == (command[0] != "admin" and command[0] != "worker")


@pytest.mark.parametrize(
    ("mode", "warned"), [(0o600, False), (0o400, False), (0o640, True), (0o604, True)]
)
def test_a_token_file_others_may_read_is_warned_about(
    tmp_path: Path, mode: int, warned: bool
) -> None:
    token_file = tmp_path / "me.token"
    token_file.write_text("qlo1_secret")
    token_file.chmod(mode)
    context = OperatorContext(
        "h:1", TlsFiles(tmp_path / "ca", tmp_path / "c", tmp_path / "k"), token_file, "p"
    )
    warning = context.token_file_warning()
    if not warned:
        assert warning is None
        return
    assert warning is not None
    assert f"{mode:04o}" in warning
    assert f"chmod 600 {token_file}" in warning
    assert "qlo1_secret" not in warning
    missing = OperatorContext("h:1", context.tls, tmp_path / "absent", "p")
    assert missing.token_file_warning() is None  # reading it for a call says why


def test_the_command_line_warns_about_an_exposed_token_file_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real entry point: the warning is on stderr before the call is tried (here the
    call fails on the missing certificate), never on stdout, never with the token."""
    for variable in _VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    pki = ensure_dev_pki(tmp_path / "pki")
    identity = ensure_operator_identity(pki, "dora")
    token_file = tmp_path / "me.token"
    token_file.write_text("qlo1_never-printed")
    token_file.chmod(0o644)
    code = cli_main.main(
        [
            "run",
            "list",
            "--address",
            "127.0.0.1:9",
            "--ca-cert",
            str(identity.ca_cert),
            "--cert",
            str(identity.cert),
            "--key",
            str(identity.key),
            "--token-file",
            str(token_file),
            "--project",
            "p",
        ]
    )
    out, err = capsys.readouterr()
    assert code != 0
    assert out == ""
    assert err.startswith(f"warning: the token file {token_file} can be read by other users")
    assert "qlo1_never-printed" not in err
