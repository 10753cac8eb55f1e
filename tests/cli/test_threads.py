"""CPU threads chosen for the machine: the physical cores the process may use (hyper-threads once), or
OMP_NUM_THREADS, or what the user asks; the engine applies them; OpenMP's threads sleep between parallel regions
unless the environment says otherwise (benchmarks/threads-cpu-default-model.json)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltaspec import LLM
from deltaspec.config import host
from deltaspec.config.engine import EngineConfig
from deltaspec.config.resolve import resolve_engine_config
from deltaspec.errors import DeltaspecError


def fake_topology(tmp_path: Path, cores_of_cpus: dict[int, tuple[int, int]]) -> Path:
    """A /sys/devices/system/cpu tree whose CPU n sits on (package, core) `cores_of_cpus[n]`."""
    for cpu, (package, core) in cores_of_cpus.items():
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    return tmp_path


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """Eight logical CPUs: four cores with two hyper-threads each, on one package."""
    root = fake_topology(tmp_path, {cpu: (0, cpu // 2) for cpu in range(8)})
    monkeypatch.setattr(host, "Path", lambda p: root / Path(p).relative_to("/sys/devices/system/cpu"))
    return monkeypatch


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity masks here")
@pytest.mark.parametrize(
    ("allowed", "cores"),
    [(range(8), 4), ([0, 1], 1), ([0, 2, 4], 3), ([1, 2, 3, 4, 5], 3)],
)
def test_physical_cores_count_each_allowed_core_once(machine, allowed, cores):
    machine.setattr(os, "sched_getaffinity", lambda pid: set(allowed))
    machine.delenv("OMP_NUM_THREADS", raising=False)
    assert host.physical_cores() == cores
    assert host.default_threads() == cores


def test_omp_num_threads_wins_over_the_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert host.default_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "zero")
    assert host.default_threads() == host.physical_cores()


def test_the_engine_runs_with_the_threads_asked_for():
    before = torch.get_num_threads()
    try:
        llm = LLM(dtype="float32", device="cpu", max_num_seqs=1, max_model_len=256, threads=1)
        assert llm.engine.config.host.threads == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_zero_threads_are_refused_in_one_sentence():
    with pytest.raises(DeltaspecError, match="threads must be at least 1"):
        resolve_engine_config(EngineConfig.from_flat(device="cpu", threads=0), None)


@pytest.mark.parametrize(("given", "seen"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_openmp_threads_sleep_unless_the_environment_says_otherwise(given, seen):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    code = "import deltaspec, os; print(os.environ['OMP_WAIT_POLICY'])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == seen
