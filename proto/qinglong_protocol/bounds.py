"""Field bounds of the QingLong wire contracts, as constants and pure validators.

Every bound of a request field is declared once, as a ``buf.validate`` rule in the
``.proto`` files; the constants here are read from those declarations at import
(:mod:`qinglong_protocol.contract_rules`), so Python code that needs a number (the
Worker's own limits, a CLI default, a test's edge value) uses the contract's. What no
rule can say lives here as the one place: byte caps on whole messages, the meaning of
``page_size == 0``, the lease capability's strength, and bounds of values the servers
produce (event types, error codes). Ingress and control enforce the rules themselves
with the contract's validator (:mod:`qinglong_protocol.request_bounds`).

String lengths are in UTF-8 bytes unless a name says ``_CHARS`` (Unicode code
points). All patterns are anchored with ``\\A`` and ``\\Z`` and must be used with
``fullmatch``/``match`` as written: a trailing newline never passes.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import re
from collections.abc import Sequence
from typing import Final

from qinglong.control.v1 import run_service_pb2
from qinglong.rpc.v1 import execution_pb2, rules_pb2
from qinglong.worker.v1 import worker_service_pb2

from qinglong_protocol.contract_rules import (
    field_rules,
    int_range,
    predefined_pattern,
    predefined_range,
    string_rules,
)

_PLAN = execution_pb2.ExecutionPlan
_WS = worker_service_pb2
_RS = run_service_pb2

# --- Integers ---------------------------------------------------------------

#: Versions, generations and sequences stay JavaScript-safe (SPEC R-TO-2 rejects
#: non-safe integers), so every one of them is at most 2^53 - 1.
MAX_SAFE_INTEGER: Final = predefined_range(rules_pb2.safe_positive)[1]
INT32_MIN: Final = -(2**31)
INT32_MAX: Final = 2**31 - 1

TIMEOUT_MS_MIN, TIMEOUT_MS_MAX = int_range(_PLAN, "timeout_ms")
QUEUE_TIMEOUT_MS_MIN, QUEUE_TIMEOUT_MS_MAX = int_range(_PLAN, "queue_timeout_ms")
MAX_CONCURRENT_RUNS_MIN, MAX_CONCURRENT_RUNS_MAX = int_range(_PLAN, "max_concurrent_runs")
MAX_OFFERS_MAX: Final = int_range(_WS.PullOffersRequest, "max_offers")[1]
MAX_CONCURRENT_ATTEMPTS_MIN, MAX_CONCURRENT_ATTEMPTS_MAX = int_range(
    _WS.OpenSessionRequest, "max_concurrent_attempts"
)
PAGE_SIZE_MAX: Final = int_range(_RS.ListRunsRequest, "page_size")[1]
PRIORITY_MIN, PRIORITY_MAX = int_range(_RS.TriggerRunRequest, "priority")
EVENTS_PAGE_SIZE_MAX: Final = int_range(_RS.ListRunEventsRequest, "page_size")[1]
#: What ``page_size == 0`` means in every list request (no rule can declare a default;
#: the contract's comments say this number and a test holds them to it).
PAGE_SIZE_DEFAULT: Final = 50

# --- Run output (R-OPS-1) ---------------------------------------------------------------

#: The largest chunk of output one AppendOutput carries (the contract's ``data`` rule).
OUTPUT_CHUNK_MAX_BYTES: Final = field_rules(_WS.AppendOutputRequest, "data").bytes.max_len
OUTPUT_READ_MAX_BYTES: Final = int_range(_RS.ReadRunOutputRequest, "max_bytes")[1]
#: What ``max_bytes == 0`` means in ReadRunOutput (held to the contract's comment by a test).
OUTPUT_READ_DEFAULT_BYTES: Final = 256 * 1024
#: How much output one Attempt is held to by default, at both ends: the Worker writes at
#: most this much to its local file (``--output-limit-bytes``: a runaway executor cannot
#: fill the Worker's disk), and control keeps the newest this much
#: (``--output-max-bytes-per-attempt``), so by default control trims none of what came.
OUTPUT_BYTES_PER_ATTEMPT_DEFAULT: Final = 64 * 1024 * 1024

# --- Byte caps on whole messages (R-LC-1, R-ING-2) ----------------------------

#: Every WorkerService request, including the lease-control command.
WORKER_REQUEST_MAX_BYTES: Final = 8 * 1024
#: AppendOutput carries a chunk of output besides what any Worker request may carry.
APPEND_OUTPUT_REQUEST_MAX_BYTES: Final = OUTPUT_CHUNK_MAX_BYTES + WORKER_REQUEST_MAX_BYTES
LEASE_CONTROL_REQUEST_MAX_BYTES: Final = 8 * 1024
RUN_SERVICE_REQUEST_MAX_BYTES: Final = 8 * 1024
ADMIN_SERVICE_REQUEST_MAX_BYTES: Final = 8 * 1024
APPROVAL_SERVICE_REQUEST_MAX_BYTES: Final = 8 * 1024
#: A join token and a CSR: tight, since the enrollment listener asks for no credential.
ENROLLMENT_REQUEST_MAX_BYTES: Final = 8 * 1024
#: TaskService carries execution plans (argv up to 64 KiB in total).
TASK_SERVICE_REQUEST_MAX_BYTES: Final = 128 * 1024
#: The largest answer a Worker takes (its channel's receive limit: gRPC's default).
WORKER_RESPONSE_MAX_BYTES: Final = 4 * 1024 * 1024
#: PullOffers answers fewer offers rather than more bytes than this (those left out stay
#: open and come first in the next pull): the rest of the limit is room for the answer's
#: own fields and for the wrapper it travels in from control to ingress.
PULL_OFFERS_RESPONSE_MAX_BYTES: Final = WORKER_RESPONSE_MAX_BYTES - 64 * 1024
#: A repeated message field's entry around the message: its tag and length (1 + 5 bytes).
_REPEATED_ENTRY_FRAMING_BYTES: Final = 6

# --- Run parameters ---------------------------------------------------------------

_PARAMETERS = field_rules(_RS.TriggerRunRequest, "parameters").map
RUN_PARAMETERS_MAX: Final = _PARAMETERS.max_pairs
RUN_PARAMETER_VALUE_MAX_BYTES: Final = _PARAMETERS.values.string.max_bytes
RUN_PARAMETER_NAME_PATTERN: Final = re.compile(
    r"\A" + _PARAMETERS.keys.string.pattern.removeprefix("^").removesuffix("$") + r"\Z"
)
#: The longest name the pattern matches (a test holds the two together).
RUN_PARAMETER_NAME_MAX_LENGTH: Final = 64
#: An executor receives each parameter as this prefix and its name: a name cannot
#: shadow PATH or any other variable the executor or its Worker relies on.
RUN_PARAMETER_ENVIRONMENT_PREFIX: Final = "QINGLONG_PARAM_"
#: One map entry on the wire besides its name and value: the entry's tag and length,
#: the key's and the value's (at most 1 + 3 + 1 + 1 + 1 + 2 bytes).
_MAP_ENTRY_FRAMING_BYTES: Final = 9
#: TriggerRun: any RunService request, plus what its parameters may carry at most.
TRIGGER_RUN_REQUEST_MAX_BYTES: Final = RUN_SERVICE_REQUEST_MAX_BYTES + RUN_PARAMETERS_MAX * (
    RUN_PARAMETER_NAME_MAX_LENGTH + RUN_PARAMETER_VALUE_MAX_BYTES + _MAP_ENTRY_FRAMING_BYTES
)

# --- Labels: a Worker's, and those a plan's worker_selector asks for ----------------

#: A label's key (a Task's labels, a Worker's labels, a worker_selector's keys).
LABEL_KEY_PATTERN: Final = predefined_pattern(rules_pb2.label_key)
#: The longest key the pattern matches (a test holds the two together).
LABEL_KEY_MAX_LENGTH: Final = 63
_WORKER_LABELS = field_rules(_WS.OpenSessionRequest, "labels").map
#: A Worker's labels, and the entries of a plan's worker_selector (a test holds the
#: selector's declaration to these).
WORKER_LABELS_MAX: Final = _WORKER_LABELS.max_pairs
WORKER_LABEL_VALUE_MAX_BYTES: Final = _WORKER_LABELS.values.string.max_bytes
_PRINTABLE = predefined_pattern(rules_pb2.printable)


def worker_label_problem(key: str, value: str) -> str | None:
    """Why the contract refuses ``key=value`` as a Worker label, or None (for a Worker,
    which checks its configuration before it opens a session: it has no validator)."""
    if not LABEL_KEY_PATTERN.match(key):
        return (
            f"label key {key!r} must be 1..{LABEL_KEY_MAX_LENGTH} characters of a-z, 0-9,"
            " '_', '.', '-', starting with a-z"
        )
    try:
        # Strict: a value read from bytes that are not UTF-8 holds lone surrogates, which
        # no request can carry.
        size = len(value.encode())
    except UnicodeEncodeError:
        return f"label {key}'s value must be UTF-8 text"
    if size > WORKER_LABEL_VALUE_MAX_BYTES or not _PRINTABLE.match(value):
        return (
            f"label {key}'s value must be at most {WORKER_LABEL_VALUE_MAX_BYTES} bytes,"
            " without control characters"
        )
    return None


# --- Identifiers --------------------------------------------------------------

#: Server-generated ids (run, attempt, offer, session, task, revision, event,
#: audit, role binding): canonical lowercase UUID text. Derived event ids
#: (R-CONV-3, 128 bits of SHA-256) use the same form, so no version nibble check.
UUID_LENGTH: Final = 36
UUID_PATTERN: Final = predefined_pattern(rules_pb2.uuid)

#: worker_id and project_id.
SLUG_MAX_LENGTH: Final = 63
SLUG_PATTERN: Final = predefined_pattern(rules_pb2.slug)

#: request_id (AIP-155) and CancelRun's mutation_id.
REQUEST_ID_MAX_LENGTH: Final = 64
REQUEST_ID_PATTERN: Final = predefined_pattern(rules_pb2.request_id)

#: Fixed error codes such as EXECUTOR_START_FAILED.
ERROR_CODE_PATTERN: Final = re.compile(r"\A[A-Z][A-Z0-9_]{0,62}\Z")

#: RunEvent.type, e.g. ``attempt.running`` or ``run.cancel_requested``.
EVENT_TYPE_MAX_LENGTH: Final = 64
EVENT_TYPE_PATTERN: Final = re.compile(r"\A[a-z][a-z_]*(\.[a-z][a-z_]*)+\Z")

#: Server-issued opaque page tokens (base64url alphabet, no padding).
PAGE_TOKEN_MAX_LENGTH: Final = 512
PAGE_TOKEN_PATTERN: Final = predefined_pattern(rules_pb2.page_token)

# --- Secrets and digests ------------------------------------------------------


#: The lease capability (R-CLAIM-2): "qlc1_" + unpadded base64url of exactly 32
#: random bytes = 5 + 43 = 48 ASCII characters.
LEASE_CAPABILITY_PREFIX: Final = "qlc1_"
LEASE_CAPABILITY_SECRET_BYTES: Final = 32
LEASE_CAPABILITY_LENGTH: Final = 48
LEASE_CAPABILITY_PATTERN: Final = predefined_pattern(rules_pb2.lease_capability)
#: An operator bearer token (AdminService issues them): "qlo1_" + unpadded base64url of
#: 32 random bytes. Sent in a header, not a field, so no contract rule declares it.
OPERATOR_TOKEN_PATTERN: Final = re.compile(r"\Aqlo1_[A-Za-z0-9_-]{43}\Z")
#: A Worker's one-time join token (R-ADM-2): "qlj1_" + the same 43 characters.
JOIN_TOKEN_PATTERN: Final = predefined_pattern(rules_pb2.join_token)
#: A capability whose secret has fewer distinct byte values than this is weak.
#: 32 uniform random bytes have about 30 distinct values; fewer than 16 happens
#: with probability below 1e-14, so honest Workers never hit it.
LEASE_CAPABILITY_MIN_DISTINCT_BYTES: Final = 16

#: callback_token_digest and credential fingerprints: SHA-256 as lowercase hex.
SHA256_HEX_LENGTH: Final = 64
SHA256_HEX_PATTERN: Final = predefined_pattern(rules_pb2.sha256_hex)

# --- Free text ----------------------------------------------------------------

ERROR_SUMMARY_MAX_CHARS: Final = string_rules(
    _WS.ReportStartFailureRequest, "error_summary"
).max_len


def _argv_total_bytes() -> int:
    """The total the contract's argv rule allows: the number its CEL rule compares with."""
    (rule,) = (r for r in field_rules(_PLAN, "command").cel if r.id == "command.total_bytes")
    found = re.fullmatch(r".* <= (\d+)", rule.expression)
    if found is None:
        raise LookupError(f"unexpected argv total rule: {rule.expression}")
    return int(found.group(1))


_ARGV = field_rules(_PLAN, "command").repeated
COMMAND_ARGV_MAX_ITEMS: Final = _ARGV.max_items
COMMAND_ARG_MAX_BYTES: Final = _ARGV.items.string.max_bytes
COMMAND_ARGV_MAX_TOTAL_BYTES: Final = _argv_total_bytes()


# --- Validators -----------------------------------------------------------------


def utf8_length(value: str) -> int:
    """Length of ``value`` in UTF-8 bytes (the unit of most ``Bound:`` lines)."""
    return len(value.encode("utf-8", errors="surrogatepass"))


def is_uuid(value: str) -> bool:
    return UUID_PATTERN.match(value) is not None


def is_slug(value: str) -> bool:
    return SLUG_PATTERN.match(value) is not None


def is_request_id(value: str) -> bool:
    return REQUEST_ID_PATTERN.match(value) is not None


def is_error_code(value: str) -> bool:
    return ERROR_CODE_PATTERN.match(value) is not None


def is_event_type(value: str) -> bool:
    return len(value) <= EVENT_TYPE_MAX_LENGTH and EVENT_TYPE_PATTERN.match(value) is not None


def is_sha256_hex(value: str) -> bool:
    return SHA256_HEX_PATTERN.match(value) is not None


def is_safe_positive(value: int) -> bool:
    """Versions and generations: 1..2^53-1."""
    return 1 <= value <= MAX_SAFE_INTEGER


def is_safe_non_negative(value: int) -> bool:
    """Sequences and cursors: 0..2^53-1."""
    return 0 <= value <= MAX_SAFE_INTEGER


def is_timeout_ms(value: int) -> bool:
    return TIMEOUT_MS_MIN <= value <= TIMEOUT_MS_MAX


def is_command_argv(argv: Sequence[str]) -> bool:
    """1..64 items, each 1..4096 bytes with no NUL, ≤ 65536 bytes together."""
    if not 1 <= len(argv) <= COMMAND_ARGV_MAX_ITEMS:
        return False
    total = 0
    for item in argv:
        size = utf8_length(item)
        if not 1 <= size <= COMMAND_ARG_MAX_BYTES or "\x00" in item:
            return False
        total += size
    return total <= COMMAND_ARGV_MAX_TOTAL_BYTES


def offers_that_fit(sizes: Sequence[int]) -> int:
    """How many of the offers (their serialized sizes, in answer order) one PullOffers answer
    carries: the longest prefix within :data:`PULL_OFFERS_RESPONSE_MAX_BYTES`, and at least
    one (an offer at the contract's limits, 64 KiB of argv and every parameter at its
    longest, is about 100 KB; 64 of them would pass the Worker's receive limit)."""
    total = 0
    for count, size in enumerate(sizes):
        total += _REPEATED_ENTRY_FRAMING_BYTES + size
        if count and total > PULL_OFFERS_RESPONSE_MAX_BYTES:
            return count
    return len(sizes)


def decode_lease_capability(value: str) -> bytes | None:
    """The 32 secret bytes of a well-shaped capability, else ``None``."""
    if LEASE_CAPABILITY_PATTERN.match(value) is None:
        return None
    encoded = value[len(LEASE_CAPABILITY_PREFIX) :]
    try:
        raw = base64.urlsafe_b64decode(encoded + "=")
    except (binascii.Error, ValueError):
        return None
    if len(raw) != LEASE_CAPABILITY_SECRET_BYTES:
        return None
    if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != encoded:
        return None
    return raw


def is_weak_lease_secret(raw: bytes) -> bool:
    """Low-entropy secrets a broken or careless generator would produce.

    Weak: fewer than 16 distinct byte values (e.g. all zeros, repeated short
    patterns) or an arithmetic progression modulo 256 (e.g. 00 01 02 ...).
    """
    if len(set(raw)) < LEASE_CAPABILITY_MIN_DISTINCT_BYTES:
        return True
    steps = {(b - a) % 256 for a, b in itertools.pairwise(raw)}
    return len(steps) <= 1


def is_acceptable_lease_capability(value: str) -> bool:
    """Well-shaped and not weak (R-CLAIM-2)."""
    raw = decode_lease_capability(value)
    return raw is not None and not is_weak_lease_secret(raw)


def encode_lease_capability(raw: bytes) -> str:
    """Spell 32 secret bytes as a capability (what a Worker sends)."""
    if len(raw) != LEASE_CAPABILITY_SECRET_BYTES:
        raise ValueError(
            f"a lease capability secret is exactly {LEASE_CAPABILITY_SECRET_BYTES} bytes"
        )
    return LEASE_CAPABILITY_PREFIX + base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")
