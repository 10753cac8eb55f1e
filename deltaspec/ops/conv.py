"""Depthwise causal conv1d reference over ragged sequences, carrying each sequence's window.

Contract (kernels keep it): `x` holds the pre-conv rows of all sequences back to back
([T, C], split by `cu_seqlens`); sequence b continues from the window stored at
`conv_state[slots[b]]` ([K-1, C]: its last K-1 pre-conv rows, zeros for a new sequence). The
output is SiLU(conv) per row, and the window is updated in place to the sequence's last K-1
pre-conv rows.
"""

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,  # [T, C] pre-conv rows
    weight: torch.Tensor,  # [C, K]
    conv_state: torch.Tensor,  # [num_slots, K-1, C], updated in place
    query_lens: list[int],
    slots: list[int],
) -> torch.Tensor:  # [T, C]
    kernel = weight.shape[1]
    out = torch.empty_like(x)
    start = 0
    for length, slot in zip(query_lens, slots):
        rows = x[start:start + length]
        window = torch.cat((conv_state[slot].to(x.dtype), rows), dim=0)  # [K-1+L, C]
        taps = window.unfold(0, kernel, 1)  # [L, C, K]
        out[start:start + length] = F.silu((taps * weight[None].to(x.dtype)).sum(-1))
        conv_state[slot].copy_(window[-(kernel - 1):])
        start += length
    return out
