"""Pools are sized from the cores a service may use, its container's CPU limit included:
os.cpu_count() counts the node's cores, and a 1-CPU pod on a 32-core node must not open
32 connections per pool."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from qinglong_protocol.pooling import available_cores, default_max_size


def _cgroup_v2(root: Path, cpu_max: str) -> Path:
    root.mkdir(exist_ok=True)
    (root / "cpu.max").write_text(cpu_max + "\n")
    return root


def _cgroup_v1(root: Path, quota: str, period: str) -> Path:
    (root / "cpu").mkdir(parents=True, exist_ok=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text(quota + "\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text(period + "\n")
    return root


@pytest.fixture
def usable() -> int:
    return len(os.sched_getaffinity(0))


def test_a_cpu_limit_caps_the_cores(tmp_path: Path, usable: int) -> None:
    assert available_cores(_cgroup_v2(tmp_path / "one", "100000 100000")) == 1
    # 1.5 CPUs: two cores' worth of connections, never more than the process may use.
    assert available_cores(_cgroup_v2(tmp_path / "half", "150000 100000")) == min(2, usable)
    assert available_cores(_cgroup_v2(tmp_path / "tiny", "10000 100000")) == 1
    assert available_cores(_cgroup_v1(tmp_path / "v1", "200000", "100000")) == min(2, usable)


def test_no_limit_means_the_cores_the_process_may_run_on(tmp_path: Path, usable: int) -> None:
    assert available_cores(_cgroup_v2(tmp_path / "max", "max 100000")) == usable
    assert available_cores(_cgroup_v1(tmp_path / "v1", "-1", "100000")) == usable
    assert available_cores(tmp_path / "none") == usable
    assert available_cores(_cgroup_v2(tmp_path / "garbled", "lots")) == usable


def test_four_connections_per_core_within_4_to_32() -> None:
    assert [default_max_size(cores) for cores in (1, 2, 8, 9, 64)] == [4, 8, 32, 32, 32]
