"""Pools are sized from the cores a service may use, its CPU limit included:
os.cpu_count() counts the node's cores, and a 1-CPU pod on a 32-core node must not open
32 connections per pool. The limit may sit on the process's own cgroup or on one above it
(a pod's), in the unified (v2) hierarchy or v1's cpu controller."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from qinglong_protocol.pooling import available_cores, default_max_size


@pytest.fixture
def usable() -> int:
    return len(os.sched_getaffinity(0))


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _membership(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "self-cgroup"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_v2_limit_on_the_own_cgroup_caps_the_cores(tmp_path: Path, usable: int) -> None:
    root = tmp_path / "fs"
    private = _membership(tmp_path, "0::/")  # a private cgroup namespace
    for cpu_max, cores in (
        ("100000 100000", 1),
        ("150000 100000", min(2, usable)),  # 1.5 CPUs: two cores' worth
        ("10000 100000", 1),
        ("max 100000", usable),
        ("lots", usable),
    ):
        _write(root / "cpu.max", cpu_max)
        assert available_cores(root, private) == cores, cpu_max


def test_a_pods_limit_above_an_unlimited_container_counts(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    pod = root / "kubepods" / "burstable" / "pod-1"
    _write(pod / "cpu.max", "100000 100000")
    _write(pod / "ctr-1" / "cpu.max", "max 100000")
    _write(root / "cpu.max", "max 100000")
    host_namespace = _membership(tmp_path, "0::/kubepods/burstable/pod-1/ctr-1")
    assert available_cores(root, host_namespace) == 1


def test_a_v1_cpu_controller_limit_counts_on_a_hybrid_host(tmp_path: Path, usable: int) -> None:
    root = tmp_path / "fs"
    _write(root / "cpu" / "job" / "cpu.cfs_quota_us", "200000")
    _write(root / "cpu" / "job" / "cpu.cfs_period_us", "100000")
    hybrid = _membership(tmp_path, "4:memory:/job", "1:cpu,cpuacct:/job", "0::/")
    assert available_cores(root, hybrid) == min(2, usable)
    _write(root / "cpu" / "job" / "cpu.cfs_quota_us", "-1")
    assert available_cores(root, hybrid) == usable


def test_no_limit_anywhere_means_the_cores_the_process_may_run_on(
    tmp_path: Path, usable: int
) -> None:
    assert available_cores(tmp_path / "none", tmp_path / "no-membership") == usable


def test_four_connections_per_core_within_4_to_32() -> None:
    assert [default_max_size(cores) for cores in (1, 2, 8, 9, 64)] == [4, 8, 32, 32, 32]
