"""`qinglong approval …`: see and decide mutations held for approval (SPEC R-OPS-2).

An Agent's `run cancel` answers REQUIRE_APPROVAL with an approval id; a person with a
role that may stop Runs lists the pending requests and approves (the cancel then happens
as them) or denies one. Connection, identity, output and errors as in operator.py.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any, Final, TextIO

from qinglong.control.v1 import approval_pb2, approval_service_pb2, approval_service_pb2_grpc

from qinglong_cli.ingress_client import (
    OPERATOR_TOKEN,
    Session,
    add_operator_flags,
    print_pages,
    run_through_ingress,
)
from qinglong_cli.output import enum_names

COMMAND: Final = "approval"
#: `approval list --state` names.
_STATES = enum_names(approval_pb2.ApprovalState, "APPROVAL_STATE_")


def add_approval_commands(commands: Any, default_stack: Path) -> None:
    def common(parser: argparse.ArgumentParser) -> None:
        add_operator_flags(parser, default_stack)

    approval = commands.add_parser(
        COMMAND, help="list, approve and deny mutations held for approval"
    ).add_subparsers(dest="action", required=True)
    listing = approval.add_parser("list", help="list approval requests, newest first")
    common(listing)
    listing.add_argument("--limit", type=int, default=20, help="requests per page (1..500)")
    listing.add_argument(
        "--state",
        action="append",
        choices=sorted(_STATES),
        default=[],
        help="repeatable; e.g. --state pending",
    )
    listing.add_argument("--page-token", default="", help="from a previous page's footer")
    get = approval.add_parser("get", help="show one approval request, with the held request")
    common(get)
    get.add_argument("approval_id")
    for name, help_text in (
        ("approve", "approve: the held mutation runs now, as you"),
        ("deny", "deny: nothing runs"),
    ):
        decide = approval.add_parser(name, help=help_text)
        common(decide)
        decide.add_argument("approval_id")
        decide.add_argument("--note", default="", help="a note for the record (≤ 500 bytes)")


async def run_approval_command(
    args: argparse.Namespace, out: TextIO, err: TextIO | None = None
) -> int:
    """Run one approval command; the process exit code (see cli_errors)."""
    return await run_through_ingress(args, OPERATOR_TOKEN, _dispatch, out, err, needs_project=True)


async def _dispatch(args: argparse.Namespace, session: Session) -> None:
    approvals = approval_service_pb2_grpc.ApprovalServiceStub(session.channel)
    printer, call = session.printer, session.call_options()
    project = session.project_id
    if args.action == "list":
        await print_pages(
            functools.partial(approvals.ListApprovals, **call),
            approval_service_pb2.ListApprovalsRequest(
                project_id=project,
                page_size=args.limit,
                page_token=args.page_token,
                states=[_STATES[name] for name in args.state],
            ),
            lambda page: page.approvals,
            printer,
            session.err,
            follow=False,
        )
    elif args.action == "get":
        got = await approvals.GetApproval(
            approval_service_pb2.GetApprovalRequest(
                project_id=project, approval_id=args.approval_id
            ),
            **call,
        )
        printer.item(got.approval)
    elif args.action == "approve":
        approved = await approvals.Approve(
            approval_service_pb2.ApproveRequest(
                project_id=project, approval_id=args.approval_id, note=args.note
            ),
            **call,
        )
        printer.item(approved.approval)
    elif args.action == "deny":
        denied = await approvals.Deny(
            approval_service_pb2.DenyRequest(
                project_id=project, approval_id=args.approval_id, note=args.note
            ),
            **call,
        )
        printer.item(denied.approval)
