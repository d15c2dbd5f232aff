"""The cores the engine sizes llama.cpp's threads by: the affinity mask, capped by a container's CPU quota (cgroup v2
and v1 files as the kernel writes them), never the machine's count alone."""

from __future__ import annotations

import os

import pytest

from backend.common.cores import cpu_quota, usable_cores
from backend.llamacpp.speculation.threads import ThreadTuner


@pytest.fixture
def sixteen_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))


def v2(root, text: str):
    (root / "cpu.max").write_text(text)
    return root


def v1(root, quota_us: int, period_us: int = 100000):
    (root / "cpu").mkdir()
    (root / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text(f"{period_us}\n")
    return root


@pytest.mark.parametrize("write, cores", [
    (lambda root: v2(root, "200000 100000\n"), 2),
    (lambda root: v2(root, "150000 100000\n"), 2),  # a share of a core still needs a thread
    (lambda root: v2(root, "50000 100000\n"), 1),
    (lambda root: v2(root, "max 100000\n"), 16),
    (lambda root: v1(root, 400000), 4),
    (lambda root: v1(root, -1), 16),
    (lambda root: v2(root, "6400000 100000\n"), 16),  # a quota above the mask: the mask
    (lambda root: root, 16),  # no cgroup files: the mask
])
def test_a_containers_quota_caps_the_cores(tmp_path, sixteen_cpus, write, cores):
    assert usable_cores(write(tmp_path)) == cores


def test_a_garbled_quota_file_is_no_quota(tmp_path, sixteen_cpus):
    assert cpu_quota(v2(tmp_path, "nonsense\n")) is None and usable_cores(tmp_path) == 16


def test_the_affinity_mask_counts_not_the_machine(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert usable_cores(tmp_path) == 2


def test_the_thread_tuner_chooses_among_the_usable_cores(monkeypatch):
    monkeypatch.setattr("backend.llamacpp.speculation.threads.usable_cores", lambda: 2)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert ThreadTuner().candidates == [2, 1]
