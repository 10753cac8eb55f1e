"""Programmatic dependent launch (Hopper's `griddepcontrol`) for the chain of small kernels a decode step is.

Every Triton kernel of the engine starts with `wait_for_previous`, and every launch passes `LAUNCH`. With
`DELTASPEC_PDL=1`, on CUDA devices of compute capability 9.0 and later, a kernel's programs may be scheduled
onto the SMs that its predecessor's finished programs free, while that predecessor's last programs still run:
each program first lets the next kernel launch (`griddepcontrol.launch_dependents`), then waits until the
previous kernel has finished and its writes are visible (`griddepcontrol.wait`) before it reads or writes
anything. Since every kernel waits so, a kernel also sees the writes of all kernels before its predecessor;
kernels launched without it (torch's, cuBLAS's) keep the stream's ordinary order, in CUDA graphs too.
Otherwise (the default, the interpreter, older GPUs) both are nothing. It is off by default because on an H200
it sped batch-1 decode of the 27B shape up in int4 (+2.6 % and +5.9 % on two machines) and FP8 (+1.8 %, +1.6 %)
but slowed the bf16 model's (-6.2 %, -0.9 %), whose one-row products mix cuBLAS and Triton; asking for the
one-row products' weight rows to be brought into L2 before the wait made int4 decode 11 % and FP8 32 % slower
and was not kept.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _supported() -> bool:
    """Whether kernels here launch with programmatic dependent launch (asked for, and possible)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("DELTASPEC_PDL") != "1":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


ENABLED = tl.constexpr(_supported())
LAUNCH = {"launch_pdl": True} if ENABLED else {}  # the launch option of every kernel here


@triton.jit
def wait_for_previous():
    """Let the next kernel launch, then wait for the previous one to finish (see the module docstring)."""
    if ENABLED:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
