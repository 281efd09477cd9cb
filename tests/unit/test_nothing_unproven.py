"""The suite's own rule: a skipped or xfail test fails the run (tests/conftest.py).

Each case runs pytest in a subprocess on a throwaway test file, with this suite's
conftest loaded as a plugin, and reads its exit status.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]

PASSING = "def test_passes():\n    assert 1 + 1 == 2\n"

UNPROVEN = {
    "skip in a test": "import pytest\n\ndef test_s():\n    pytest.skip('not now')\n",
    "skip mark": "import pytest\n\n@pytest.mark.skip(reason='x')\ndef test_s():\n    pass\n",
    "skip of a module": "import pytest\n\npytest.skip('x', allow_module_level=True)\n",
    "xfail mark": "import pytest\n\n@pytest.mark.xfail(reason='x')\ndef test_x():\n"
    "    assert False\n",
    "xfail that passes": "import pytest\n\n@pytest.mark.xfail(reason='x')\ndef test_x():\n"
    "    pass\n",
    "xfail call": "import pytest\n\ndef test_x():\n    pytest.xfail('x')\n",
}


def _run(directory: Path, *plugin_args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            *plugin_args,
            "-c",
            "/dev/null",
            "--rootdir",
            str(directory),
            str(directory),
        ],
        cwd=REPOSITORY,
        env={"PYTHONPATH": str(REPOSITORY), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("case", sorted(UNPROVEN))
def test_an_unproven_test_fails_the_run(tmp_path: Path, case: str) -> None:
    (tmp_path / "test_passing.py").write_text(PASSING)
    (tmp_path / "test_unproven.py").write_text(UNPROVEN[case])
    result = _run(tmp_path)
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout + result.stderr
    assert "test_unproven.py" in result.stdout


def test_it_fails_without_the_terminal_reporter(tmp_path: Path) -> None:
    (tmp_path / "test_passing.py").write_text(PASSING)
    (tmp_path / "test_unproven.py").write_text(UNPROVEN["skip in a test"])
    result = _run(tmp_path, "-p", "no:terminal")
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout + result.stderr


def test_a_proven_run_passes(tmp_path: Path) -> None:
    (tmp_path / "test_passing.py").write_text(PASSING)
    result = _run(tmp_path)
    assert result.returncode == pytest.ExitCode.OK, result.stdout + result.stderr
