"""SwiGLU activation reference: `silu(gate) * up` over the fused gate|up projection."""

import torch
import torch.nn.functional as F


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first) -> [T, I], rounded like `F.silu(gate) * up` in gate_up's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
