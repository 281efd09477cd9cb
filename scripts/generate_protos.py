"""Generate the committed Python code for every QingLong ``.proto`` contract.

This is the one generator (``make generate``). It runs ``grpc_tools.protoc``
with ``-I proto`` plus the bundled well-known types, so a file at
``proto/qinglong/worker/v1/worker_service.proto`` (package
``qinglong.worker.v1``) becomes ``qinglong/worker/v1/worker_service_pb2.py`` and
its imports resolve with no rewriting. Per ``.proto`` file it emits
``*_pb2.py``, ``*_pb2_grpc.py`` and, through mypy-protobuf, ``*_pb2.pyi`` and
``*_pb2_grpc.pyi`` (no ``--pyi_out``: protoc would write the same ``.pyi`` twice).
It also writes a one-line ``__init__.py`` into every generated package directory
below ``qinglong/`` (and for the vendored ``buf/validate``) so the drift check
covers them too.

Two source trees are compiled: the contracts under ``proto/qinglong/`` and the
vendored ``proto/buf/validate/validate.proto`` (buf's protovalidate rules, Apache-2.0,
see its LICENSE), whose ``_pb2`` every annotated contract imports.

Usage::

    python scripts/generate_protos.py            # regenerate into proto/
    python scripts/generate_protos.py --out DIR  # e.g. a temp dir for the drift test

Output is deterministic: inputs are sorted, everything is first generated into a
scratch directory and then synchronised into ``--out``; generated files that no
longer have a source are deleted, and unchanged files are not rewritten.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
# Sources live in proto/qinglong/<api>/v<N>/*.proto; the root package
# proto/qinglong/__init__.py is hand-written, everything below it is generated.
# proto/buf/validate/validate.proto is vendored; all of buf/ is generated.
SOURCE_PACKAGE = "qinglong"
VENDORED_PACKAGE = "buf"
SOURCE_PACKAGES = (SOURCE_PACKAGE, VENDORED_PACKAGE)
HAND_WRITTEN = frozenset({Path(SOURCE_PACKAGE, "__init__.py")})
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def _plugin(name: str) -> Path:
    """Find a protoc plugin installed next to the running interpreter (the venv's bin/)."""
    candidate = Path(sys.executable).parent / name
    if not candidate.is_file():
        raise SystemExit(f"protoc plugin {name} not found at {candidate}; run `make bootstrap`")
    return candidate


def _well_known_include() -> Path:
    """grpc_tools ships google/protobuf/*.proto (Duration, Timestamp, ...) in its _proto dir."""
    include = Path(str(resources.files("grpc_tools") / "_proto"))
    if not (include / "google" / "protobuf" / "duration.proto").is_file():
        raise SystemExit(f"well-known types not found under {include}")
    return include


def proto_sources(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Every contract source, relative to ``proto_root``, in a stable order."""
    return sorted(
        path.relative_to(proto_root)
        for package in SOURCE_PACKAGES
        for path in (proto_root / package).rglob("*.proto")
    )


def is_generated(relative: Path) -> bool:
    """Whether a path (relative to the output root) is owned by this generator."""
    parts = relative.parts
    if len(parts) < 2 or parts[0] not in SOURCE_PACKAGES or relative in HAND_WRITTEN:
        return False
    return relative.name == "__init__.py" or relative.name.endswith(GENERATED_SUFFIXES)


def _init_docstring(package: str) -> str:
    return f'"""Generated protobuf/gRPC code for {package} (scripts/generate_protos.py)."""\n'


def _run_protoc(sources: Sequence[Path], out: Path) -> None:
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"--proto_path={PROTO_ROOT}",
        f"--proto_path={_well_known_include()}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *(source.as_posix() for source in sources),
    ]
    # Run from the proto root so every path protoc sees is relative and stable.
    result = subprocess.run(args, cwd=PROTO_ROOT, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.stderr.write(result.stdout + result.stderr)
        raise SystemExit(f"protoc failed with exit code {result.returncode}")


def _write_inits(scratch: Path, sources: Sequence[Path]) -> None:
    packages: set[tuple[str, ...]] = set()
    for source in sources:
        parts = source.parent.parts  # ("qinglong", "<api>", "v1") or ("buf", "validate")
        for depth in range(1, len(parts) + 1):
            packages.add(parts[:depth])
    for package in sorted(packages):
        if Path(*package, "__init__.py") in HAND_WRITTEN:
            continue
        init = scratch.joinpath(*package, "__init__.py")
        init.parent.mkdir(parents=True, exist_ok=True)
        init.write_text(_init_docstring(".".join(package)), encoding="utf-8", newline="\n")


def _sync(scratch: Path, out: Path) -> list[str]:
    """Make the generated files under ``out`` equal to ``scratch``; describe each change."""
    wanted = {
        path.relative_to(scratch)
        for path in scratch.rglob("*")
        if path.is_file() and is_generated(path.relative_to(scratch))
    }
    changed: list[str] = []
    for relative in sorted(wanted):
        data = (scratch / relative).read_bytes()
        target = out / relative
        if target.is_file() and target.read_bytes() == data:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        changed.append(f"updated {relative.as_posix()}")
    for package in SOURCE_PACKAGES:
        root = out / package
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*")):
            relative = path.relative_to(out)
            if path.is_file() and is_generated(relative) and relative not in wanted:
                path.unlink()
                changed.append(f"removed {relative.as_posix()}")
    return changed


def generate(out: Path) -> list[str]:
    """Generate every contract into ``out``; describe each file that changed."""
    sources = proto_sources()
    if not sources:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    with tempfile.TemporaryDirectory(prefix="qinglong-protos-") as tmp:
        scratch = Path(tmp)
        _run_protoc(sources, scratch)
        _write_inits(scratch, sources)
        return _sync(scratch, out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out",
        type=Path,
        default=PROTO_ROOT,
        help="output root (default: proto/, beside the sources)",
    )
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    changed = generate(out)
    for change in changed:
        print(change)
    print(f"{len(changed)} generated file(s) changed under {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
