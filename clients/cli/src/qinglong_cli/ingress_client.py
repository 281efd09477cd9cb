"""How every `qinglong` command that calls ingress reaches it, authenticates and answers.

A command needs four connection settings — the ingress address, the CA certificate that
signed ingress's, and the caller's client certificate and key (ingress requires mutual TLS
of every caller) — plus the file holding a bearer token, and for `task`, `run` and
`approval` a project. They come from one of two places, chosen as a whole:

* **explicit settings**: `--address`, `--ca-cert`, `--cert`, `--key`, each else its
  environment variable (`QINGLONG_ADDRESS`, `QINGLONG_CA_CERT`, `QINGLONG_CERT`,
  `QINGLONG_KEY`). As soon as any of the four is set, all four must be, and so must the
  token file and (where needed) the project: whatever is missing is a ConfigurationError
  naming it, and the stack file is not read at all. A certificate of one deployment is
  never paired with another's address.
* **the stack file** (`--stack`, else `$QINGLONG_STACK`, else `.qinglong/stack.json`,
  which `qinglong up` writes), when none of the four is set. An explicit `--stack` flag
  wins over the four environment variables (flags win over the environment) but cannot
  be combined with the four flags; `$QINGLONG_STACK` only moves the default, so any of
  the four still means explicit settings.

The token file and the project are resolved on their own, in both cases: the flag
(`--token-file`, `--project`), else the environment (`QINGLONG_TOKEN_FILE` for an
operator's commands, `QINGLONG_ADMIN_TOKEN_FILE` for `admin` and `worker`;
`QINGLONG_PROJECT`), else — with a stack file only — the stack file.

`run_through_ingress` is the one wrapper around a command: it resolves those settings
(the only place the environment is read), opens the channel, hands the command a Session
(channel, token, printer), and turns every failure into a message on stderr and an exit
code (cli_errors.py). The token is read when a call is made and never printed; a token
file other users may read is used, with a warning on stderr (`chmod 600` it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
import sys
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, TextIO

import grpc
from google.protobuf.message import Message
from qinglong_protocol.tls import TlsFiles, mutual_tls_channel_credentials

from qinglong_cli.cli_errors import (
    EXIT_OK,
    EXIT_RUN_NOT_SUCCEEDED,
    ConfigurationError,
    NotFoundError,
    PendingApproval,
    RunNotSucceeded,
    UnknownOutcome,
    report_configuration_error,
    report_not_found,
    report_pending_approval,
    report_rpc_error,
    report_unknown_outcome,
)
from qinglong_cli.output import OutputFormat, Printer

TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class Setting:
    """One explicit setting: its flag and the environment variable that stands in for it."""

    flag: str
    environment_variable: str
    what: str

    def names(self) -> str:
        return f"{self.flag} or ${self.environment_variable}"


ADDRESS: Final = Setting("--address", "QINGLONG_ADDRESS", "the ingress address")
CA_CERT: Final = Setting("--ca-cert", "QINGLONG_CA_CERT", "the CA certificate")
CERT: Final = Setting("--cert", "QINGLONG_CERT", "the client certificate")
KEY: Final = Setting("--key", "QINGLONG_KEY", "the client key")
PROJECT: Final = Setting("--project", "QINGLONG_PROJECT", "the project")
#: All of them or none: with none, the stack file supplies the connection.
CONNECTION: Final = (ADDRESS, CA_CERT, CERT, KEY)
#: Where the stack file is when --stack is not given (else the command's default).
STACK_VARIABLE: Final = "QINGLONG_STACK"


@dataclass(frozen=True)
class TokenSource:
    """Where a kind of caller's bearer token file is named."""

    stack_key: str  # the stack file's section whose `token_file` names it
    environment_variable: str

    @property
    def setting(self) -> Setting:
        return Setting(
            "--token-file", self.environment_variable, f"the {self.stack_key} token file"
        )


OPERATOR_TOKEN = TokenSource("operator", "QINGLONG_TOKEN_FILE")
ADMIN_TOKEN = TokenSource("admin", "QINGLONG_ADMIN_TOKEN_FILE")


@dataclass(frozen=True)
class ConnectionArguments:
    """What one command was given on its command line (None: not given)."""

    default_stack: Path
    stack: Path | None = None
    address: str | None = None
    ca_cert: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    token_file: Path | None = None
    project: str | None = None

    @classmethod
    def of(cls, args: argparse.Namespace) -> ConnectionArguments:
        """From the flags `add_connection_flags` (and `add_operator_flags`) defined."""
        return cls(
            default_stack=args.default_stack,
            stack=args.stack,
            address=args.address,
            ca_cert=args.ca_cert,
            cert=args.cert,
            key=args.key,
            token_file=args.token_file,
            project=getattr(args, "project", None),
        )

    def flag_value(self, setting: Setting) -> str | Path | None:
        return {
            ADDRESS: self.address,
            CA_CERT: self.ca_cert,
            CERT: self.cert,
            KEY: self.key,
            PROJECT: self.project,
        }[setting]


@dataclass(frozen=True)
class OperatorContext:
    """Where ingress is, the TLS identity every command presents, the bearer token file
    that says who is calling, and the project (None for a cluster admin's commands when
    none was named)."""

    address: str
    tls: TlsFiles
    token_file: Path
    project_id: str | None
    #: The stack file the address and TLS files came from; None: explicit settings.
    stack_file: Path | None = None

    @classmethod
    def resolve(
        cls,
        given: ConnectionArguments,
        source: TokenSource,
        environ: Mapping[str, str],
        *,
        needs_project: bool,
    ) -> OperatorContext:
        """The settings of one command, by the rules in this module's docstring; any
        problem is a ConfigurationError that names the setting or the file."""
        flagged = [setting for setting in CONNECTION if given.flag_value(setting)]
        if given.stack is not None:
            if flagged:
                raise ConfigurationError(
                    f"--stack cannot be combined with {', '.join(s.flag for s in flagged)}: "
                    "take the connection from the stack file or from --address, --ca-cert, "
                    "--cert and --key, not both"
                )
            return cls.from_stack(
                given.stack,
                source,
                project_id=_explicit(given, PROJECT, environ),
                token_file=given.token_file,
                environ=environ,
            )
        values = {setting: _explicit(given, setting, environ) for setting in CONNECTION}
        if not any(values.values()):
            return cls.from_stack(
                Path(environ.get(STACK_VARIABLE) or given.default_stack),
                source,
                project_id=_explicit(given, PROJECT, environ),
                token_file=given.token_file,
                environ=environ,
            )
        token_file = given.token_file or environ.get(source.environment_variable) or None
        project = _explicit(given, PROJECT, environ)
        wanted = {**values, source.setting: token_file}
        if needs_project:
            wanted[PROJECT] = project
        missing = [setting for setting, value in wanted.items() if not value]
        if missing:
            named = ", ".join(_origin(given, s) for s in CONNECTION if values[s])
            raise ConfigurationError(
                f"incomplete connection settings: {named} given, but not "
                + "; ".join(f"{s.what} ({s.names()})" for s in missing)
                + ". Give --address, --ca-cert, --cert, --key and the token file (flags "
                "or environment) together, or none of the four to use the stack file"
            )
        address = str(values[ADDRESS])
        _check_address(address)
        return cls(
            address=address,
            tls=TlsFiles(
                Path(str(values[CA_CERT])), Path(str(values[CERT])), Path(str(values[KEY]))
            ),
            token_file=Path(str(token_file)),
            project_id=project,
        )

    @classmethod
    def from_stack(
        cls,
        path: Path,
        source: TokenSource,
        *,
        project_id: str | None = None,
        token_file: Path | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> OperatorContext:
        """Read the stack file; any problem is a ConfigurationError naming the file."""
        try:
            stack = json.loads(path.read_text())
            operator = stack["operator"]
            context = cls(
                address=stack["ingress"]["address"],
                tls=TlsFiles(Path(stack["ca_cert"]), Path(operator["cert"]), Path(operator["key"])),
                token_file=token_file or _token_file(stack, path, source, environ),
                project_id=project_id or stack["project_id"],
                stack_file=path,
            )
        except FileNotFoundError:
            raise ConfigurationError(
                f"no stack file at {path}; start the stack with `qinglong up`, pass --stack, "
                "or give --address, --ca-cert, --cert and --key (or $QINGLONG_ADDRESS, "
                "$QINGLONG_CA_CERT, $QINGLONG_CERT, $QINGLONG_KEY)"
            ) from None
        except (OSError, ValueError) as error:
            raise ConfigurationError(f"cannot read stack file {path}: {error}") from None
        except (KeyError, TypeError) as error:
            raise ConfigurationError(
                f"stack file {path} is not one `qinglong up` wrote (missing {error})"
            ) from None
        return context

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Mutual TLS: present our certificate, verify ingress's against the CA. An
        unreadable file is a ConfigurationError naming it and where it was named."""
        for setting, path in (
            (CA_CERT, self.tls.ca_cert),
            (CERT, self.tls.cert),
            (KEY, self.tls.key),
        ):
            try:
                path.open("rb").close()  # opened, not read: the reading is the helper's
            except OSError as error:
                named_by = (
                    setting.names()
                    if self.stack_file is None
                    else f"named in stack file {self.stack_file}"
                )
                raise ConfigurationError(
                    f"cannot read {setting.what} {path} ({named_by}): {error.strerror}"
                ) from None
        return mutual_tls_channel_credentials(self.tls)

    def token_file_warning(self) -> str | None:
        """What to say when the token file may be read by other users of this machine
        (anyone who reads it can act as you); None when it may not, or cannot be looked
        at (reading it for a call then says why)."""
        try:
            mode = self.token_file.stat().st_mode
        except OSError:
            return None
        if not stat.S_ISREG(mode) or not mode & (stat.S_IRWXG | stat.S_IRWXO):
            return None
        return (
            f"warning: the token file {self.token_file} can be read by other users "
            f"(mode {stat.S_IMODE(mode):04o}); anyone who reads it can act as you: "
            f"chmod 600 {self.token_file}"
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        # Read at call time and never printed.
        try:
            token = self.token_file.read_text().strip()
        except OSError as error:
            raise ConfigurationError(
                f"cannot read the token file {self.token_file}: {error.strerror}"
            ) from None
        return (("authorization", "Bearer " + token),)


def _explicit(
    given: ConnectionArguments, setting: Setting, environ: Mapping[str, str]
) -> str | None:
    """The flag's value, else the environment variable's; None when neither (an empty
    variable counts as unset)."""
    flagged = given.flag_value(setting)
    if flagged:
        return str(flagged)
    return environ.get(setting.environment_variable) or None


def _origin(given: ConnectionArguments, setting: Setting) -> str:
    return setting.flag if given.flag_value(setting) else "$" + setting.environment_variable


def _check_address(address: str) -> None:
    host, colon, port = address.rpartition(":")
    if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
        raise ConfigurationError(
            f"{ADDRESS.names()} must be HOST:PORT (e.g. ingress.example.com:7443): {address!r}"
        )


def _token_file(
    stack: dict[str, Any], path: Path, source: TokenSource, environ: Mapping[str, str] | None
) -> Path:
    named = (os.environ if environ is None else environ).get(source.environment_variable)
    if named:
        return Path(named)
    section = stack.get(source.stack_key)
    if not isinstance(section, dict) or "token_file" not in section:
        # A stack file from before the section existed: say how to get past it.
        raise ConfigurationError(
            f"stack file {path} names no {source.stack_key} token file; restart "
            f"`qinglong up`, or pass --token-file or {source.environment_variable}"
        )
    return Path(section["token_file"])


def add_connection_flags(
    parser: argparse.ArgumentParser, default_stack: Path, source: TokenSource
) -> Any:
    """The connection flags, --token-file and --output: what every command that calls
    ingress takes. Returns the "connection" argument group."""
    group = parser.add_argument_group(
        "connection",
        "Either all of --address, --ca-cert, --cert and --key (each flag else its "
        "environment variable), with a token file and (for task, run and approval) a "
        "project; or none of the four: then the connection comes from the stack file "
        "`qinglong up` wrote. Flags win over the environment; --stack cannot be combined "
        "with the four flags.",
    )
    parser.set_defaults(default_stack=default_stack)
    group.add_argument(
        "--stack",
        type=Path,
        metavar="PATH",
        help=f"stack file of `qinglong up`, used when none of the four settings below is "
        f"given [${STACK_VARIABLE}, else {default_stack}]",
    )
    group.add_argument(
        "--address",
        metavar="HOST:PORT",
        help=f"ingress's address [${ADDRESS.environment_variable}]",
    )
    group.add_argument(
        "--ca-cert",
        type=Path,
        metavar="PATH",
        help=f"the CA certificate that signed ingress's (PEM) [${CA_CERT.environment_variable}]",
    )
    group.add_argument(
        "--cert",
        type=Path,
        metavar="PATH",
        help=f"your client certificate, signed by the cluster's CA (PEM) "
        f"[${CERT.environment_variable}]",
    )
    group.add_argument(
        "--key",
        type=Path,
        metavar="PATH",
        help=f"the client certificate's private key (PEM) [${KEY.environment_variable}]",
    )
    group.add_argument(
        "--token-file",
        type=Path,
        metavar="PATH",
        help=f"file holding your bearer token [${source.environment_variable}; with a stack "
        f"file, default: its {source.stack_key} token]",
    )
    parser.add_argument(
        "--output",
        type=OutputFormat,
        choices=list(OutputFormat),
        help="table (default on a terminal), json, or jsonl (default otherwise)",
    )
    return group


def add_operator_flags(parser: argparse.ArgumentParser, default_stack: Path) -> None:
    """An operator command's flags: the connection, the operator's token, and the project."""
    group = add_connection_flags(parser, default_stack, OPERATOR_TOKEN)
    group.add_argument(
        "--project",
        metavar="ID",
        help=f"project id [${PROJECT.environment_variable}; with a stack file, default: its "
        "project; required with the four settings above]",
    )


@dataclass(frozen=True)
class Session:
    """What one command works with: its context, the channel to ingress, and where
    answers (the printer) and notes (err) go."""

    context: OperatorContext
    channel: grpc.aio.Channel
    printer: Printer
    err: TextIO

    @property
    def project_id(self) -> str:
        """The project an operator's command acts in (resolution made sure there is one)."""
        if self.context.project_id is None:
            raise ConfigurationError(f"no project: pass {PROJECT.names()}")
        return self.context.project_id

    def call_options(self) -> dict[str, Any]:
        """The keyword arguments of a unary call: the bearer token and the deadline."""
        return {"metadata": self.context.metadata(), "timeout": TIMEOUT_SECONDS}


#: One command: its parsed arguments and the session it runs in.
Command = Callable[[argparse.Namespace, Session], Awaitable[None]]


async def run_through_ingress(
    args: argparse.Namespace,
    source: TokenSource,
    command: Command,
    out: TextIO,
    err: TextIO | None = None,
    *,
    needs_project: bool,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Run one command against ingress; the process exit code (see cli_errors).
    `environ` (default: the process's) supplies the settings' environment variables."""
    err = sys.stderr if err is None else err
    output = args.output or (OutputFormat.TABLE if out.isatty() else OutputFormat.JSONL)
    printer = Printer(out, output)
    try:
        context = OperatorContext.resolve(
            ConnectionArguments.of(args),
            source,
            os.environ if environ is None else environ,
            needs_project=needs_project,
        )
        credentials = context.channel_credentials()
        warning = context.token_file_warning()
        if warning is not None:
            print(warning, file=err)
        async with grpc.aio.secure_channel(context.address, credentials) as channel:
            await command(args, Session(context, channel, printer, err))
    except ConfigurationError as error:
        if printer.holds_items:  # printed before the problem was found (a secret not saved)
            printer.close()
        return report_configuration_error(error, err)
    except NotFoundError as error:
        printer.close()
        return report_not_found(error, err)
    except UnknownOutcome as unknown:
        printer.close()
        return report_unknown_outcome(unknown, err)
    except PendingApproval as pending:
        printer.close()
        return report_pending_approval(pending, err)
    except RunNotSucceeded as ended:
        printer.close()
        print(f"the run ended {ended}", file=err)
        return EXIT_RUN_NOT_SUCCEEDED
    except grpc.aio.AioRpcError as error:
        printer.close()
        return report_rpc_error(error, err)
    printer.close()
    return EXIT_OK


# --- creates ----------------------------------------------------------------------------------


def add_request_id_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--request-id",
        help="idempotency key: the same command with the same key is done at most once and"
        " answers as the first time (default: a fresh one, named if the answer is lost)",
    )


def request_id_of(args: argparse.Namespace) -> str:
    """The create's AIP-155 request id: the user's ``--request-id``, or a fresh one."""
    return str(args.request_id or uuid.uuid4().hex)


# --- pages ----------------------------------------------------------------------------------


class PagedRequest(Protocol):
    page_token: str


async def pages(
    call: Callable[[Any], Awaitable[Any]], request: PagedRequest
) -> AsyncGenerator[Any, None]:
    """Every page of a listing, following `next_page_token` (the request is updated)."""
    while True:
        page = await call(request)
        yield page
        if not page.next_page_token:
            return
        request.page_token = page.next_page_token


async def print_pages(
    call: Callable[[Any], Awaitable[Any]],
    request: PagedRequest,
    items: Callable[[Any], Iterable[Message]],
    printer: Printer,
    err: TextIO,
    *,
    follow: bool,
) -> None:
    """Print one page (and how to ask for the next on stderr), or with `follow` all."""
    async with contextlib.aclosing(pages(call, request)) as listing:
        async for page in listing:
            for item in items(page):
                printer.item(item)
            if page.next_page_token and not follow:
                print(f"next page: --page-token {page.next_page_token}", file=err)
                return


def add_paging_flags(parser: argparse.ArgumentParser, noun: str) -> None:
    parser.add_argument(
        "--page-size", type=int, default=0, help=f"{noun} per page (1..500; default 50)"
    )
    parser.add_argument("--page-token", default="", help="from a previous page's footer")
    parser.add_argument("--all", action="store_true", help="follow every page to the end")
