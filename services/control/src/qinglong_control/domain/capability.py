"""The Worker-generated lease capability (SPEC R-CLAIM-2) and the digests stored for it.

Format: `qlc1_` + unpadded base64url of exactly 32 random bytes (48 characters). The
plaintext never goes past this module: callers turn it into a digest at the boundary
and carry only the digest from then on (SPEC R-SEC-1).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from dataclasses import dataclass

from qinglong_control.domain.refusals import Reason, Refused

CAPABILITY_PREFIX = "qlc1_"
CAPABILITY_BYTES = 32
_SHAPE = re.compile(r"^qlc1_[A-Za-z0-9_-]{43}$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")

# 32 uniformly random bytes show about 30 distinct values; fewer than 16 happens with
# probability far below 2^-100, while repeated or patterned "secrets" fall under it.
_MIN_DISTINCT_BYTES = 16


@dataclass(frozen=True)
class TokenDigest:
    """Lowercase hex SHA-256 of a secret. Compared in constant time."""

    hex: str

    def matches(self, other_hex: str) -> bool:
        return hmac.compare_digest(self.hex, other_hex)

    def __repr__(self) -> str:
        # Digests are not secrets, but they are not for logs either (SPEC R-SEC-1).
        return "TokenDigest(<redacted>)"


def digest_of_capability(capability: str) -> TokenDigest:
    """Validate a lease capability's shape and strength and return its digest."""
    if not _SHAPE.match(capability):
        raise Refused(Reason.CAPABILITY_MALFORMED, "lease capability has the wrong shape")
    try:
        raw = base64.urlsafe_b64decode(capability[len(CAPABILITY_PREFIX) :] + "=")
    except (binascii.Error, ValueError):
        raise Refused(Reason.CAPABILITY_MALFORMED, "lease capability is not base64url") from None
    if len(raw) != CAPABILITY_BYTES or _encode(raw) != capability:
        # Non-canonical encodings (stray bits in the last character) would give two
        # plaintexts for one secret.
        raise Refused(Reason.CAPABILITY_MALFORMED, "lease capability is not canonical")
    if len(set(raw)) < _MIN_DISTINCT_BYTES:
        raise Refused(Reason.CAPABILITY_WEAK, "lease capability has too little entropy")
    return TokenDigest(hashlib.sha256(capability.encode("ascii")).hexdigest())


def parse_digest(value: str) -> TokenDigest:
    """A digest given on the wire (e.g. the callback token digest): 64 lowercase hex."""
    if not _SHA256_HEX.match(value):
        raise Refused(Reason.FIELD_INVALID, "digest must be 64 lowercase hex characters")
    return TokenDigest(value)


def _encode(raw: bytes) -> str:
    return CAPABILITY_PREFIX + base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def new_capability(random_bytes: bytes) -> str:
    """Encode 32 random bytes as a capability (Workers call this with `secrets.token_bytes`)."""
    if len(random_bytes) != CAPABILITY_BYTES:
        raise ValueError("a lease capability needs exactly 32 random bytes")
    return _encode(random_bytes)
