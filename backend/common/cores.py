"""How many cores this process may use: the CPUs its affinity mask allows, and no more than its cgroup's CPU quota
(a container's CPU limit) where one is set. `os.cpu_count()` is the machine's: a Kubernetes node's 64 for a pod
limited to 2, where 64 llama.cpp threads would spend their quota waiting for each other.

The quota is read where a container sees its own cgroup (cgroup v2's cpu.max at the root of its namespace, or
v1's cpu controller); a process in a nested cgroup of a host is taken at its affinity.
"""

from __future__ import annotations

import math
import os
import pathlib

CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")


def usable_cores(cgroup_root: pathlib.Path = CGROUP_ROOT) -> int:
    cores = len(os.sched_getaffinity(0))
    quota = cpu_quota(cgroup_root)
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def cpu_quota(cgroup_root: pathlib.Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup's quota allows (a share of its period), or None where no quota is set."""
    try:  # cgroup v2: "<quota> <period>", quota "max" for none
        quota, period = (cgroup_root / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1: quota -1 for none
        quota_us = int((cgroup_root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup_root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None
