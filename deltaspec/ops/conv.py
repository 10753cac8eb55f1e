"""Depthwise causal conv1d reference over ragged sequences, carrying each sequence's window.

Contract (kernels keep it): `x` holds the pre-conv rows of all sequences back to back
([T, C], split as `layout` says, `deltaspec.ops.layout`); sequence b continues from the window stored at
`conv_state[slots[b]]` ([K-1, C]: its last K-1 pre-conv rows, zeros for a new sequence). The
output is SiLU(conv) per row, and the window is updated in place to the sequence's last K-1
pre-conv rows.

Replay log (as for the GDN state, see `ops.gdn`): a `speculative` sequence leaves its window
alone and writes its pre-conv rows to `log[slot, :n]`; `fold` accepted log rows are shifted into
the window before the sequence's next rows are processed.
"""

import torch
import torch.nn.functional as F

from deltaspec.ops.layout import SeqLayout, chain_parents


def _path(parents: list[int], row: int, kernel: int) -> list[int]:
    """The positions row `row` convolves, oldest first: its K - 1 nearest ancestors, then itself (negative
    positions are the window's rows before the sequence's first row)."""
    path = [row]
    while len(path) < kernel:
        last = path[-1]
        path.append(parents[last] if last >= 0 else last - 1)
    return path[::-1]


def causal_conv1d(
    x: torch.Tensor,  # [T, C] pre-conv rows
    weight: torch.Tensor,  # [C, K]
    conv_state: torch.Tensor,  # [num_slots, K-1, C], updated in place
    layout: SeqLayout,
    log: torch.Tensor | None = None,  # [num_slots, L, C]; needed when a sequence is speculative or folds
) -> torch.Tensor:  # [T, C]
    kernel = weight.shape[1]
    out = torch.empty_like(x)
    start, tree = 0, layout.tree
    for b, (length, slot, n, spec) in enumerate(zip(layout.query_lens, layout.slots, layout.fold, layout.speculative)):
        if n:
            folded = log[slot, tree.fold_rows[b]] if tree is not None else log[slot, :n]
            conv_state[slot].copy_(torch.cat((conv_state[slot], folded.to(conv_state.dtype)))[-(kernel - 1) :])
        rows = x[start : start + length]
        window = torch.cat((conv_state[slot].to(x.dtype), rows), dim=0)  # [K-1+L, C]
        if spec and tree is not None and tree.parents[b] != chain_parents(length):
            paths = [_path(tree.parents[b], i, kernel) for i in range(length)]
            taps = window[torch.tensor(paths, device=x.device) + kernel - 1].permute(0, 2, 1)  # [L, C, K]
        else:
            taps = window.unfold(0, kernel, 1)  # [L, C, K]
        out[start : start + length] = F.silu((taps * weight[None].to(x.dtype)).sum(-1))
        if spec:
            log[slot, :length] = rows
        else:
            conv_state[slot].copy_(window[-(kernel - 1) :])
        start += length
    return out
