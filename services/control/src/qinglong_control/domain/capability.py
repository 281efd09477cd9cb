"""The Worker-generated lease capability (SPEC R-CLAIM-2) and the digests stored for it.

Shape and strength rules live once, in `qinglong_protocol.bounds` (pure Python, shared
with ingress and the Worker). This module turns an accepted capability into the only
thing the runtime keeps: its SHA-256 digest. The plaintext goes no further than here.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from qinglong_protocol import bounds

from qinglong_control.domain.refusals import Reason, Refused


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
    raw = bounds.decode_lease_capability(capability)
    if raw is None:
        raise Refused(Reason.CAPABILITY_MALFORMED, "lease capability has the wrong shape")
    if bounds.is_weak_lease_secret(raw):
        raise Refused(Reason.CAPABILITY_WEAK, "lease capability has too little entropy")
    return TokenDigest(hashlib.sha256(capability.encode("ascii")).hexdigest())


def parse_digest(value: str) -> TokenDigest:
    """A digest given on the wire (e.g. the callback token digest): 64 lowercase hex."""
    if not bounds.is_sha256_hex(value):
        raise Refused(Reason.FIELD_INVALID, "digest must be 64 lowercase hex characters")
    return TokenDigest(value)
