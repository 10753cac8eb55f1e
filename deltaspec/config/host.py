"""What the host gives when the user leaves it out: the default device and the default CPU threads (the physical
cores the process may use)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_threads() -> int:
    """CPU threads when --threads is not given: OMP_NUM_THREADS when the environment sets it (as torch reads it),
    else the physical cores the process may use."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else physical_cores()


def physical_cores() -> int:
    """The physical cores among the CPUs this process may run on (its affinity mask): logical CPUs that share a
    core (hyper-threads) count once; every allowed CPU where the kernel does not say which core it is."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks (macOS, Windows)
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))
