"""How every `qinglong` command that calls ingress reaches it, authenticates and answers.

Connection and identity come from a stack file (`qinglong up` writes one): the ingress
address, the CA and the operator's client certificate (mutual TLS is required of every
caller), and the file holding a bearer token. Which token depends on the command: the
operator's for `task` and `run`, the cluster admin's for `admin` and `worker`. A token file
is chosen by `--token-file`, else by an environment variable, else by the stack file, so a
script can point one command at another principal without editing `stack.json`.

`run_through_ingress` is the one wrapper around a command: it opens the channel, hands the
command a Session (channel, token, printer), and turns every failure into a message on
stderr and an exit code (cli_errors.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

import grpc
from google.protobuf.message import Message
from qinglong_protocol.tls import TlsFiles, mutual_tls_channel_credentials

from qinglong_cli.cli_errors import (
    EXIT_OK,
    ConfigurationError,
    NotFoundError,
    report_configuration_error,
    report_not_found,
    report_rpc_error,
)
from qinglong_cli.output import OutputFormat, Printer

TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class TokenSource:
    """Where a kind of caller's bearer token file is named."""

    stack_key: str  # the stack file's section whose `token_file` names it
    environment_variable: str


OPERATOR_TOKEN = TokenSource("operator", "QINGLONG_TOKEN_FILE")
ADMIN_TOKEN = TokenSource("admin", "QINGLONG_ADMIN_TOKEN_FILE")


@dataclass(frozen=True)
class OperatorContext:
    """Where ingress is, the TLS identity every command presents (the stack's operator
    certificate), the bearer token file that says who is calling, and the project."""

    address: str
    tls: TlsFiles
    token_file: Path
    project_id: str

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
            )
        except FileNotFoundError:
            raise ConfigurationError(
                f"no stack file at {path}; start the stack with `qinglong up` or pass --stack"
            ) from None
        except (OSError, ValueError) as error:
            raise ConfigurationError(f"cannot read stack file {path}: {error}") from None
        except (KeyError, TypeError) as error:
            raise ConfigurationError(
                f"stack file {path} is not one `qinglong up` wrote (missing {error})"
            ) from None
        return context

    def metadata(self) -> tuple[tuple[str, str], ...]:
        # Read at call time and never printed.
        try:
            token = self.token_file.read_text().strip()
        except OSError as error:
            raise ConfigurationError(
                f"cannot read the token file {self.token_file}: {error.strerror}"
            ) from None
        return (("authorization", "Bearer " + token),)


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
) -> None:
    """--stack, --token-file and --output: what every command that calls ingress takes."""
    parser.add_argument("--stack", type=Path, default=default_stack)
    parser.add_argument(
        "--token-file",
        type=Path,
        help=f"bearer token file (default: ${source.environment_variable}, else the "
        f"stack file's {source.stack_key} token)",
    )
    parser.add_argument(
        "--output",
        type=OutputFormat,
        choices=list(OutputFormat),
        help="table (default on a terminal), json, or jsonl (default otherwise)",
    )


def add_operator_flags(parser: argparse.ArgumentParser, default_stack: Path) -> None:
    """An operator command's flags: the connection, the operator's token, and the project."""
    add_connection_flags(parser, default_stack, OPERATOR_TOKEN)
    parser.add_argument("--project", help="project id (default: the stack's project)")


@dataclass(frozen=True)
class Session:
    """What one command works with: the stack's context, the channel to ingress, and
    where answers (the printer) and notes (err) go."""

    context: OperatorContext
    channel: grpc.aio.Channel
    printer: Printer
    err: TextIO

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
) -> int:
    """Run one command against ingress; the process exit code (see cli_errors)."""
    err = sys.stderr if err is None else err
    output = args.output or (OutputFormat.TABLE if out.isatty() else OutputFormat.JSONL)
    printer = Printer(out, output)
    try:
        context = OperatorContext.from_stack(
            args.stack,
            source,
            project_id=getattr(args, "project", None),
            token_file=args.token_file,
        )
        credentials = mutual_tls_channel_credentials(context.tls)
        async with grpc.aio.secure_channel(context.address, credentials) as channel:
            await command(args, Session(context, channel, printer, err))
    except ConfigurationError as error:
        return report_configuration_error(error, err)
    except NotFoundError as error:
        printer.close()
        return report_not_found(error, err)
    except grpc.aio.AioRpcError as error:
        printer.close()
        return report_rpc_error(error, err)
    printer.close()
    return EXIT_OK


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
