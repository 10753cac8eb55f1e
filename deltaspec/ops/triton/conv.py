"""Triton depthwise causal conv1d with the signature and semantics of `deltaspec.ops.conv.causal_conv1d`.

One program per (block of a sequence's rows, sequence, channel block) computes its rows at once:
each of the K taps is a masked load of the pre-conv row it needs, taken from `x` inside the
sequence and, before its first row, from the slot's window with the `fold` accepted log rows
shifted in (`cat(window, log[:fold])[fold + K - 1 + i]` for position i < 0). The program holding a
sequence's first row block also writes the new window (the folded one for a speculative sequence
that folded, the last K-1 rows otherwise) and the speculative rows' log; those are the only
programs reading the window and log, so a barrier between their loads and stores orders them.
Per-sequence values come from the layout's device tensors; the launch is shaped by `num_seqs`,
`max_query_len` and tensor shapes only. Arithmetic is float32, rounded once to x's dtype.

Trees (`layout.tree`, compiled in with HAS_TREE; only its device tensors are read): the window's folded rows are
the log rows `fold_rows_t[seq]` (stacked index s >= K-1 reads log row `fold_rows_t[seq, s - (K-1)]`), and a
speculative sequence's tap at distance d from row i reads position up^d(i), up(p) = `parent_t[first_row + p]`
inside the sequence and p - 1 in the window. A tree's row may then reach the window from any row of the
sequence, so a tree pass takes row blocks of up to MAX_TREE_ROWS rows: a tree fits the first, and only the
first block still reads the window and log.
"""

import torch
import triton
import triton.language as tl

from deltaspec.ops.layout import MAX_TREE_ROWS, SeqLayout
from deltaspec.ops.triton import pdl

MAX_ROW_BLOCK = 32
TREE_ROW_BLOCK = triton.next_power_of_2(MAX_TREE_ROWS)  # rows per program in a tree pass: a whole tree
TILE_ELEMENTS = 1024  # rows x channels per program


@triton.jit
def _window_rows(
    positions,
    position_mask,
    channels,
    channel_mask,
    slot,
    num_fold,
    fold_rows_ptr,
    conv_state_ptr,
    log_ptr,
    state_stride_slot,
    state_stride_row,
    log_stride_slot,
    log_stride_row,
    K: tl.constexpr,
    HAS_LOG: tl.constexpr,
    HAS_TREE: tl.constexpr,
):
    """The folded window at positions -(K-1)..-1 ([N] int, masked), in conv_state's dtype: [N, BC]. With
    HAS_TREE, fold step j is log row `fold_rows_ptr[j]` (the sequence's row of `fold_rows_t`)."""
    stacked = num_fold + (K - 1) + positions  # [N] index into cat(window, log rows)
    from_window = stacked < K - 1
    window = tl.load(
        conv_state_ptr + slot * state_stride_slot + stacked[:, None] * state_stride_row + channels[None, :],
        mask=(position_mask & from_window)[:, None] & channel_mask[None, :],
        other=0.0,
    )
    if HAS_LOG:
        log_rows = stacked - (K - 1)  # [N] fold steps
        if HAS_TREE:
            log_rows = tl.load(fold_rows_ptr + log_rows, mask=position_mask & ~from_window, other=0)
        logged = tl.load(
            log_ptr + slot * log_stride_slot + log_rows[:, None] * log_stride_row + channels[None, :],
            mask=(position_mask & ~from_window)[:, None] & channel_mask[None, :],
            other=0.0,
        )
        window = tl.where(from_window[:, None], window, logged.to(conv_state_ptr.dtype.element_ty))
    return window


@triton.jit
def _pre_conv_rows(
    positions,
    position_mask,
    channels,
    channel_mask,
    first_row,
    slot,
    num_fold,
    fold_rows_ptr,
    x_ptr,
    conv_state_ptr,
    log_ptr,
    x_stride_t,
    state_stride_slot,
    state_stride_row,
    log_stride_slot,
    log_stride_row,
    K: tl.constexpr,
    HAS_LOG: tl.constexpr,
    HAS_TREE: tl.constexpr,
):
    """Pre-conv rows at sequence positions `positions` ([N]; negative ones from the folded window),
    rounded to x's dtype like the reference's window, as float32: [N, BC]."""
    in_sequence = positions >= 0
    rows = tl.load(
        x_ptr + (first_row + positions)[:, None] * x_stride_t + channels[None, :],
        mask=(position_mask & in_sequence)[:, None] & channel_mask[None, :],
        other=0.0,
    )
    window = _window_rows(
        positions,
        position_mask & ~in_sequence,
        channels,
        channel_mask,
        slot,
        num_fold,
        fold_rows_ptr,
        conv_state_ptr,
        log_ptr,
        state_stride_slot,
        state_stride_row,
        log_stride_slot,
        log_stride_row,
        K,
        HAS_LOG,
        HAS_TREE,
    )
    return tl.where(in_sequence[:, None], rows, window.to(x_ptr.dtype.element_ty)).to(tl.float32)


@triton.jit
def _tree_positions(positions, position_mask, parents_ptr, follows_tree, DISTANCE: tl.constexpr):
    """up^DISTANCE of sequence positions `positions` ([N]): up(p) is p's parent row (`parents_ptr[p]`, the
    sequence's `parent_t`) for p >= 0 where the sequence `follows_tree`, else p - 1."""
    for _ in tl.static_range(DISTANCE):
        in_tree = (positions >= 0) & follows_tree
        parents = tl.load(parents_ptr + positions, mask=position_mask & in_tree, other=0)
        positions = tl.where(in_tree, parents, positions - 1)
    return positions


@triton.jit
def _conv_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    conv_state_ptr,
    log_ptr,
    query_start_ptr,
    slots_ptr,
    fold_ptr,
    speculative_ptr,
    parent_ptr,
    fold_rows_ptr,
    x_stride_t,
    weight_stride_c,
    out_stride_t,
    state_stride_slot,
    state_stride_row,
    log_stride_slot,
    log_stride_row,
    num_channels,
    log_rows,
    fold_rows_stride,
    K: tl.constexpr,
    WINDOW_BLOCK: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    HAS_LOG: tl.constexpr,
    HAS_TREE: tl.constexpr,
):
    pdl.wait_for_previous()
    row_block = tl.program_id(0)
    seq = tl.program_id(1)
    first_row = tl.load(query_start_ptr + seq).to(tl.int64)
    num_rows = tl.load(query_start_ptr + seq + 1).to(tl.int64) - first_row
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    num_fold = tl.load(fold_ptr + seq)
    speculative = tl.load(speculative_ptr + seq) != 0
    seq_fold_rows_ptr = fold_rows_ptr + seq * fold_rows_stride  # [L] this sequence's fold map (HAS_TREE)
    channels = tl.program_id(2) * BC + tl.arange(0, BC)
    channel_mask = channels < num_channels
    positions = row_block * BT + tl.arange(0, BT)  # [BT] rows of this program, within the sequence
    row_mask = positions < num_rows

    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for tap in tl.static_range(K):
        weight = tl.load(weight_ptr + channels * weight_stride_c + tap, mask=channel_mask, other=0.0)
        weight = weight.to(x_ptr.dtype.element_ty).to(tl.float32)  # [BC]
        if HAS_TREE:
            tap_positions = _tree_positions(positions, row_mask, parent_ptr + first_row, speculative, K - 1 - tap)
        else:
            tap_positions = positions + (tap - (K - 1))
        rows = _pre_conv_rows(
            tap_positions,
            row_mask,
            channels,
            channel_mask,
            first_row,
            slot,
            num_fold,
            seq_fold_rows_ptr,
            x_ptr,
            conv_state_ptr,
            log_ptr,
            x_stride_t,
            state_stride_slot,
            state_stride_row,
            log_stride_slot,
            log_stride_row,
            K,
            HAS_LOG,
            HAS_TREE,
        )  # [BT, BC]
        acc += rows * weight[None, :]
    out = acc * tl.sigmoid(acc)

    # The new window, written (with the log) only by the program holding the sequence's first rows.
    window_index = tl.arange(0, WINDOW_BLOCK)
    writes_window = (window_index < K - 1) & (row_block == 0) & ((speculative == 0) | (num_fold > 0))  # [W]
    last_rows = _pre_conv_rows(
        num_rows - (K - 1) + window_index,
        writes_window & (speculative == 0),
        channels,
        channel_mask,
        first_row,
        slot,
        num_fold,
        seq_fold_rows_ptr,
        x_ptr,
        conv_state_ptr,
        log_ptr,
        x_stride_t,
        state_stride_slot,
        state_stride_row,
        log_stride_slot,
        log_stride_row,
        K,
        HAS_LOG,
        HAS_TREE,
    )  # [W, BC]
    folded = _window_rows(
        window_index - (K - 1),
        writes_window & speculative,
        channels,
        channel_mask,
        slot,
        num_fold,
        seq_fold_rows_ptr,
        conv_state_ptr,
        log_ptr,
        state_stride_slot,
        state_stride_row,
        log_stride_slot,
        log_stride_row,
        K,
        HAS_LOG,
        HAS_TREE,
    )  # [W, BC]
    new_window = tl.where(speculative, folded, last_rows.to(conv_state_ptr.dtype.element_ty))  # [W, BC]
    tl.debug_barrier()  # every read of this slot's window and log rows comes before the writes below

    tl.store(
        out_ptr + (first_row + positions)[:, None] * out_stride_t + channels[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & channel_mask[None, :],
    )
    tl.store(
        conv_state_ptr + slot * state_stride_slot + window_index[:, None] * state_stride_row + channels[None, :],
        new_window,
        mask=writes_window[:, None] & channel_mask[None, :],
    )
    if HAS_LOG:
        logged_rows = tl.where((row_block == 0) & speculative, tl.minimum(num_rows, log_rows), 0)
        log_row = tl.zeros((), dtype=tl.int64)
        while log_row < logged_rows:
            block_rows = log_row + tl.arange(0, BT)  # [BT]
            block_mask = (block_rows < logged_rows)[:, None] & channel_mask[None, :]
            logged = tl.load(
                x_ptr + (first_row + block_rows)[:, None] * x_stride_t + channels[None, :], mask=block_mask, other=0.0
            )  # [BT, BC]
            tl.store(
                log_ptr + slot * log_stride_slot + block_rows[:, None] * log_stride_row + channels[None, :],
                logged.to(log_ptr.dtype.element_ty),
                mask=block_mask,
            )
            log_row += BT


def causal_conv1d(
    x: torch.Tensor,  # [T, C] pre-conv rows
    weight: torch.Tensor,  # [C, K]
    conv_state: torch.Tensor,  # [num_slots, K-1, C], updated in place
    layout: SeqLayout,
    log: torch.Tensor | None = None,  # [num_slots, L, C]; needed when a sequence is speculative or folds
) -> torch.Tensor:  # [T, C]
    assert x.is_contiguous(), "x must be a contiguous [T, C] tensor"
    num_channels, kernel_size = weight.shape
    # Only the first row block reaches back into the window: later blocks start >= MAX_ROW_BLOCK rows in, and
    # in a tree pass a tree's rows all lie in the first.
    assert 2 <= kernel_size <= MAX_ROW_BLOCK + 1
    assert weight.stride(1) == 1 and conv_state.stride(2) == 1
    out = torch.empty_like(x)  # [T, C]
    has_log = log is not None
    if has_log:
        assert log.stride(2) == 1
    log_tensor = log if has_log else conv_state
    log_strides = (log.stride(0), log.stride(1)) if has_log else (0, 0)
    tree = layout.tree
    if tree is not None:
        tree_tensors, fold_rows_stride = (tree.parent_t, tree.fold_rows_t), tree.fold_rows_t.stride(0)
    else:
        tree_tensors, fold_rows_stride = (layout.query_start,) * 2, 0
    max_row_block = MAX_ROW_BLOCK if tree is None else TREE_ROW_BLOCK
    row_block = min(max_row_block, max(2, triton.next_power_of_2(layout.max_query_len)))
    channel_block = min(max(16, TILE_ELEMENTS // row_block), triton.next_power_of_2(num_channels))
    grid = (triton.cdiv(layout.max_query_len, row_block), layout.num_seqs, triton.cdiv(num_channels, channel_block))
    _conv_kernel[grid](
        x,
        weight,
        out,
        conv_state,
        log_tensor,
        layout.query_start,
        layout.slots_t,
        layout.fold_t,
        layout.speculative_t,
        *tree_tensors,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        *log_strides,
        num_channels,
        log_tensor.shape[1],
        fold_rows_stride,
        K=kernel_size,
        WINDOW_BLOCK=triton.next_power_of_2(kernel_size - 1),
        BT=row_block,
        BC=channel_block,
        HAS_LOG=has_log,
        HAS_TREE=tree is not None,
        **pdl.LAUNCH,
    )
    return out
