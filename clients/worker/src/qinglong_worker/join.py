"""`qinglong-worker join`: a new Worker machine gets its identity (R-ADM-2).

    qinglong-worker join --ingress HOST:PORT --enrollment HOST:PORT --ca CA.pem \
                         --token-file TOKEN --dir DIR

An administrator creates the Worker (`qinglong admin worker create NAME`) and hands its
one-time join token to the machine. Here the machine generates its private key, sends
only a certificate signing request and the token to ingress's enrollment listener
(server-authenticated TLS: the machine has no client certificate yet, so it checks the
server against the CA it was given), and writes the certificate it gets back next to
its key. The key never leaves the machine; the token is used once and never written.

The directory then holds everything `qinglong-worker run` needs:

    worker.key   the private key (0600)
    worker.crt   the client certificate, naming the Worker in its SAN URI, then the
                 intermediate CAs it is presented with (when an intermediate issues it)
    ca.crt       the CA certificates that verify ingress: the one given with --ca (it
                 just did) and the roots control named
    worker.json  the worker id, the ingress address and these paths
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from qinglong.enrollment.v1 import enrollment_service_pb2, enrollment_service_pb2_grpc
from qinglong_protocol.files import atomic_write

KEY_FILE: Final = "worker.key"
CERTIFICATE_FILE: Final = "worker.crt"
CA_FILE: Final = "ca.crt"
#: Written with the key before a join is sent, removed once it is answered: the digest of
#: the token the key is for (a lost answer's retry presents the same key, no other does).
PENDING_FILE: Final = "join.pending"
IDENTITY_FILE: Final = "worker.json"
DEFAULT_TIMEOUT_SECONDS: Final = 15.0


@dataclass(frozen=True)
class JoinedIdentity:
    worker_id: str
    ingress_address: str
    directory: Path

    @property
    def key(self) -> Path:
        return self.directory / KEY_FILE

    @property
    def certificate(self) -> Path:
        return self.directory / CERTIFICATE_FILE

    @property
    def ca(self) -> Path:
        return self.directory / CA_FILE


def new_private_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def signing_request(key: ec.EllipticCurvePrivateKey) -> str:
    """A CSR for ``key``. Its subject is a placeholder: the CA names the certificate after
    the Worker the join token belongs to and takes only the public key from here."""
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "qinglong-worker")])
    csr = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())
    return csr.public_bytes(serialization.Encoding.PEM).decode("ascii")


def join(
    ingress_address: str,
    ca_pem: bytes,
    join_token: str,
    directory: Path,
    *,
    enrollment_address: str,
    server_name: str | None = None,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
) -> JoinedIdentity:
    """Enroll this machine (once per directory) at ``enrollment_address`` (ingress's
    enrollment listener) and record ``ingress_address`` (its public listener) as where the
    Worker will run. Raises ``grpc.RpcError`` with the server's typed status when the
    join fails: refused, nothing is left written (the key is removed too); unanswered
    (UNAVAILABLE, DEADLINE_EXCEEDED), the key stays for the retry, which presents it
    again. FileExistsError in a directory that already holds an identity. A one-shot
    command, so a blocking channel."""
    # worker.json records absolute paths: the daemon may run from any directory.
    directory = directory.resolve()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if (directory / IDENTITY_FILE).exists():
        # A join token works once; joining again here would replace the key of a working
        # identity before the (second) token is even checked.
        raise FileExistsError(f"{directory / IDENTITY_FILE} exists: this machine has joined")
    pending = hashlib.sha256(join_token.encode("ascii")).hexdigest()
    key = _key_of_an_unanswered_join(directory, pending)
    if key is None:
        key = new_private_key()
        # The key is on disk (0600) before anything leaves the machine, so a certificate
        # is never issued for a key that could be lost; the pending mark names the token
        # it is for, so only a retry of this very join presents it again.
        write_private(directory / KEY_FILE, private_key_pem(key))
        write_private(directory / PENDING_FILE, pending.encode("ascii"))
    options = [] if server_name is None else [("grpc.ssl_target_name_override", server_name)]
    credentials = grpc.ssl_channel_credentials(root_certificates=ca_pem)
    try:
        with grpc.secure_channel(enrollment_address, credentials, options=options) as channel:
            stub = enrollment_service_pb2_grpc.EnrollmentServiceStub(channel)
            answer = stub.JoinWorker(
                enrollment_service_pb2.JoinWorkerRequest(
                    join_token=join_token, certificate_signing_request_pem=signing_request(key)
                ),
                timeout=timeout_seconds,
            )
    except grpc.RpcError as error:
        # The answer may be lost after control spent the token for this key: the retry
        # must present the same key, for which control answers the same token again
        # (until the token expires). A refusal spent nothing: the key goes.
        failed: Any = error  # a failed call's error is also its grpc.Call
        if failed.code() not in _TRY_AGAIN:
            _forget_pending(directory)
        raise
    except BaseException:
        _forget_pending(directory)
        raise
    write_public(directory / CERTIFICATE_FILE, answer.certificate_pem)
    # The CA given here verified ingress just now; control's roots are kept beside it (a
    # Worker told to trust only what control names could lose ingress, an intermediate).
    write_public(
        directory / CA_FILE, trust_bundle(ca_pem.decode("ascii"), answer.ca_certificates_pem)
    )
    identity = JoinedIdentity(answer.worker_id, ingress_address, directory)
    write_public(
        directory / IDENTITY_FILE,
        json.dumps(
            {
                "worker_id": identity.worker_id,
                "ingress_address": ingress_address,
                "tls_ca": str(identity.ca),
                "tls_cert": str(identity.certificate),
                "tls_key": str(identity.key),
                "expire_time": answer.expire_time.ToJsonString(),
            },
            indent=2,
        )
        + "\n",
    )
    # Answered: the key is the identity's now, no join's to retry.
    (directory / PENDING_FILE).unlink(missing_ok=True)
    return identity


def private_key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _key_of_an_unanswered_join(directory: Path, pending: str) -> ec.EllipticCurvePrivateKey | None:
    """The key a join of this very token left here when its answer never came (the
    pending mark names the token's digest), to be presented again; None otherwise — a
    key of an earlier identity (its worker.json moved aside to join anew) or one copied
    with a disk image is never reused."""
    try:
        if (directory / PENDING_FILE).read_text(encoding="ascii").strip() != pending:
            return None
        key = serialization.load_pem_private_key((directory / KEY_FILE).read_bytes(), None)
    except (OSError, ValueError, TypeError):
        return None
    return key if isinstance(key, ec.EllipticCurvePrivateKey) else None


def _forget_pending(directory: Path) -> None:
    """A join that was answered with a refusal spent nothing: its key and mark go."""
    (directory / KEY_FILE).unlink(missing_ok=True)
    (directory / PENDING_FILE).unlink(missing_ok=True)


def trust_bundle(*bundles: str) -> str:
    """The certificates of ``bundles`` (PEM), each once, in the order first seen."""
    seen: dict[bytes, str] = {}
    for bundle in bundles:
        for certificate in x509.load_pem_x509_certificates(bundle.encode("ascii")):
            der = certificate.public_bytes(serialization.Encoding.DER)
            seen.setdefault(der, certificate.public_bytes(serialization.Encoding.PEM).decode())
    return "".join(seen.values())


def write_private(path: Path, data: bytes) -> None:
    atomic_write(path, data, 0o600)


def write_public(path: Path, text: str) -> None:
    atomic_write(path, text.encode("ascii"), 0o644)


#: Failures after which the same join may simply be tried again (exit 3, as the CLI's).
_TRY_AGAIN: Final = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def join_main(argv: list[str]) -> int:
    """``qinglong-worker join``; exit 0 once the identity is written, 1 when refused, 3
    when ingress's enrollment listener could not be reached or did not answer in time:
    try the same command again — the key stays, and a token the lost answer spent is
    answered again for it until the token expires."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="qinglong-worker join", description="Enroll this machine as a Worker."
    )
    parser.add_argument(
        "--ingress", required=True, help="ingress's public listener, HOST:PORT (recorded)"
    )
    parser.add_argument(
        "--enrollment",
        required=True,
        help="ingress's enrollment listener, HOST:PORT (not the public listener: that one"
        " asks for the certificate a joining machine does not have yet)",
    )
    parser.add_argument("--ca", type=Path, required=True, help="CA certificate(s) of ingress")
    token = parser.add_mutually_exclusive_group(required=True)
    token.add_argument("--token", help="the join token (visible to other users in ps)")
    token.add_argument("--token-file", type=Path, help="a file holding the join token")
    parser.add_argument("--dir", type=Path, required=True, help="where the identity is written")
    parser.add_argument("--server-name", help="name to expect in ingress's certificate")
    args = parser.parse_args(argv)
    join_token = args.token or args.token_file.read_text(encoding="ascii").strip()
    try:
        identity = join(
            args.ingress,
            args.ca.read_bytes(),
            join_token,
            args.dir,
            enrollment_address=args.enrollment,
            server_name=args.server_name,
        )
    except FileExistsError as error:
        print(f"join refused: {error}", file=sys.stderr)
        return 1
    except grpc.RpcError as error:
        # A failed call's error is also its grpc.Call (the stubs cannot say so).
        call: Any = error
        code: grpc.StatusCode = call.code()
        if code in _TRY_AGAIN:
            print(
                f"join failed: {code.name}: {call.details()} (is --enrollment {args.enrollment}"
                " ingress's enrollment listener, and reachable? run the same command again"
                " before the token expires: it is answered again for this machine's key)",
                file=sys.stderr,
            )
            return 3
        print(f"join refused: {code.name}: {call.details()}", file=sys.stderr)
        return 1
    print(
        f"joined as {identity.worker_id}; run with: qinglong-worker run "
        f"--identity {identity.directory / IDENTITY_FILE} --inbox PATH"
    )
    return 0
