"""Fixtures shared by every test: real PostgreSQL 16 and 18, one database per test.

There is no fallback: if the embedded server cannot start, every test that needs it
errors loudly. A skipped test fails the run (see pytest_sessionfinish).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from qinglong_protocol.pooling import available_cores

from tests.support.fault_tally import Tally
from tests.support.postgres import Cluster, Clusters, MigratedDatabase

SUPPORTED_POSTGRES_VERSIONS = (16, 18)


@pytest.fixture(scope="session")
def postgres_clusters() -> Iterator[Clusters]:
    # Not under pytest's basetemp: pytest deletes all but its three newest basetemp
    # directories, so a second pytest run on the machine could delete a live cluster.
    root = Path(tempfile.mkdtemp(prefix="qinglong-pg-"))
    clusters = Clusters(root)
    try:
        yield clusters
    finally:
        clusters.stop_all()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(
    scope="session",
    params=SUPPORTED_POSTGRES_VERSIONS,
    ids=[f"pg{v}" for v in SUPPORTED_POSTGRES_VERSIONS],
)
def pg_cluster(request: pytest.FixtureRequest, postgres_clusters: Clusters) -> Cluster:
    """The contract suite's backend: every test using it runs on each supported version."""
    version: int = request.param
    return postgres_clusters.get(version)


@pytest.fixture
def database(pg_cluster: Cluster) -> Iterator[MigratedDatabase]:
    """A freshly migrated database of this test's own, on each supported version."""
    with pg_cluster.database() as db:
        yield db


@pytest.fixture
def database_pg18(postgres_clusters: Clusters) -> Iterator[MigratedDatabase]:
    """One database on the default version, for tests that are not about the backend."""
    with postgres_clusters.get(18).database() as db:
        yield db


_TALLY_PROPERTY = "qinglong-tally"


@pytest.fixture
def report_tally(request: pytest.FixtureRequest) -> Callable[[Tally], None]:
    """Fault and failover suites: print a scenario's tally now (visible with -s and in a
    failure's captured output) and keep it for the end-of-session table. It travels in the
    test's report (a user property): with several pytest-xdist workers, the table is
    printed by the process that sees every report, not by the one that ran the test."""

    def report(tally: Tally) -> None:
        print(tally.render(), flush=True)
        request.node.user_properties.append((_TALLY_PROPERTY, (tally.clean, tally.row())))

    return report


class _TallyTable:
    """Collects the tallies from the reports (of this process's tests, or of the workers')."""

    def __init__(self) -> None:
        self.rows: list[tuple[bool, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "teardown":  # its properties include those the call added
            return
        for name, value in report.user_properties:
            if name == _TALLY_PROPERTY:
                clean, row = value
                self.rows.append((bool(clean), str(row)))

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.rows:
            return
        terminalreporter.section(
            "fault and failover tallies (lost, duplicates and wrong outcomes: 0)"
        )
        for clean, row in self.rows:
            terminalreporter.write_line(("ok   " if clean else "FAIL ") + row)


class _NothingUnproven:
    """No skipped tests in CI: a skip, an expected failure (xfail, strict or not) or an
    unexpected pass each mean that something was not proven, so the run fails. Counted
    from each report, not from the terminal reporter's tallies (absent under
    `-p no:terminal`)."""

    def __init__(self) -> None:
        self.unproven: list[str] = []

    def _note(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if hasattr(report, "wasxfail"):
            self.unproven.append(f"xfail: {report.nodeid}")
        elif report.skipped:
            self.unproven.append(f"skipped: {report.nodeid}")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._note(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._note(report)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self.unproven or exitstatus != 0:
            return
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"FAILED: {len(self.unproven)} test(s) skipped or xfail; neither is allowed.",
                red=True,
            )
            for line in self.unproven:
                reporter.write_line(f"  {line}", red=True)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: no error when it is not loaded
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (make test): one worker per core this process may use — its CPU affinity
    capped by its cgroup's quota, as the services size their pools — not the host's
    physical cores, which on a large CI node running a small container would start dozens
    of workers, each with its own PostgreSQL servers."""
    return available_cores()


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_NothingUnproven(), "qinglong-nothing-unproven")
    config.pluginmanager.register(_TallyTable(), "qinglong-tally-table")
