"""The distribution boundaries of the workspace (issue: layout and packaging)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _requirement_names(distribution: str) -> set[str]:
    names = set()
    for requirement in metadata.requires(distribution) or []:
        match = re.match(r"[A-Za-z0-9_.-]+", requirement)
        assert match is not None
        names.add(match[0].lower().replace("_", "-"))
    return names


def _imported_modules(package_dir: Path) -> set[str]:
    modules = set()
    for path in package_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules.add(node.module)
    return modules


def test_console_scripts_exist() -> None:
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts["qinglong"] == "qinglong_cli.main:main"
    assert scripts["qinglong-control"] == "qinglong_control.main:main"
    assert scripts["qinglong-ingress"] == "qinglong_ingress.main:main"
    assert scripts["qinglong-worker"] == "qinglong_worker.main:main"


def test_worker_does_not_depend_on_psycopg() -> None:
    assert not any("psycopg" in name for name in _requirement_names("qinglong-worker"))
    imported = _imported_modules(ROOT / "clients/worker/src/qinglong_worker")
    assert not any(name.split(".")[0] in {"psycopg", "psycopg_pool"} for name in imported)


def test_ingress_contains_no_runtime_repository() -> None:
    imported = _imported_modules(ROOT / "services/ingress/src/qinglong_ingress")
    assert not any(name.split(".")[0] == "qinglong_control" for name in imported)
    assert "qinglong-control" not in _requirement_names("qinglong-ingress")
    # And at run time: starting ingress's entry point loads nothing of control.
    probe = (
        "import sys, qinglong_ingress.service;"
        " print(any(m.startswith('qinglong_control') for m in sys.modules))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "False"


def test_domain_code_imports_neither_grpc_nor_psycopg() -> None:
    imported = _imported_modules(ROOT / "services/control/src/qinglong_control/domain")
    assert not any(name.split(".")[0] in {"grpc", "psycopg", "psycopg_pool"} for name in imported)
    assert not any(name.startswith("qinglong.") for name in imported)


def test_ingress_entry_point_restricts_tls_before_grpc_loads() -> None:
    """grpc reads GRPC_SSL_CIPHER_SUITES once, at import: main must not import it first."""
    probe = "import sys, qinglong_ingress.main; print('grpc' in sys.modules)"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "False"
