"""Triton gated delta rule with the signature and semantics of `deltaspec.ops.gdn.gated_delta_rule`.

Recurrent path (decode, verify, mixed passes; CUDA-graph safe): one program per (sequence, value
head, Dv block) holds its [Dk, BV] block of the slot's state in float32 registers, replays the
sequence's `fold` logged rows onto it, then runs the sequence's rows one by one. A speculative
sequence writes back the folded state (only if it folded); any other writes its final state. A state stored in
bf16 or fp16 is rounded to that dtype after every row, as single-row steps store it (the reference's
`stepwise`), so speculative rows give plain decoding's results.
Every per-sequence value is read from the layout's device tensors; the launch is shaped by
`num_seqs`, `max_query_len` and tensor shapes only.

Trees (`layout.tree`, compiled in with HAS_TREE; only its device tensors are read): fold step j replays log row
`fold_rows_t[seq, j]`, and a speculative sequence's row continues the state after its parent row. The program
still holds one running state block and no per-row states: a row flagged TREE_RESTART reloads the folded state
from the slot (stored there above when the sequence folded, else still there) and replays its ancestors' rows
onto it, each rounded as a row is; after a row flagged TREE_KEEP the running state is the one after that row,
after a leaf it stays its parent's. Other sequences' rows are chains.

The replay log of speculative rows is written by a second, small kernel launched after the
recurrence: a sequence that folds and is speculative in the same pass reads log rows (to fold)
that the pass also overwrites, and the readers are spread over many programs, so the writes must
wait for the whole recurrence.

Plain prefill (`max_query_len > 64`, no sequence speculative or folding, on CUDA) runs fla's
chunked kernel instead, gathering the slots' states and scattering the final ones back.
"""

import torch
import triton
import triton.language as tl

from deltaspec.ops.gdn import GDNLog
from deltaspec.ops.layout import TREE_KEEP, TREE_RESTART, SeqLayout
from deltaspec.ops.triton import pdl

PREFILL_MIN_QUERY_LEN = 64  # a pass whose max_query_len exceeds this is prefill: never captured
FLA_CHUNK_ROWS = 64  # rows per chunk of fla's chunk_gated_delta_rule (its default chunk_size)
MAX_KEY_DIM = 256
# Dv columns per program, warps and pipeline stages: near-best on the H200 from 1 to 32 decoding sequences
# (tools/gdn_launch_sweep.py: 8.1 / 21.6 / 66.9 us at 1 / 8 / 32 sequences; 3 stages took 14.8 us at 1)
VALUE_BLOCK = 32
RECURRENT_WARPS = 2
RECURRENT_STAGES = 1
KEEP = tl.constexpr(TREE_KEEP)  # the layout's recurrence hints, as the kernel reads them
RESTART = tl.constexpr(TREE_RESTART)


@triton.jit
def _delta_step(state, key, value, decay, beta):
    """One row of the recurrence on a [BK, BV] state block: key [BK], value [BV], decay, beta scalars."""
    state = state * tl.exp(decay)
    correction = beta * (value - tl.sum(state * key[:, None], axis=0))  # [BV]
    return state + key[:, None] * correction[None, :]


@triton.jit
def _row_step(
    state,
    row,
    key_head,
    head,
    dk_offsets,
    dk_mask,
    dv_offsets,
    dv_mask,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    g_stride_t,
    beta_stride_t,
):
    """`_delta_step` on row `row`'s inputs (k, v, g, beta) for this program's [BK, BV] state block."""
    key = tl.load(k_ptr + row * k_stride_t + key_head * k_stride_h + dk_offsets, mask=dk_mask, other=0.0).to(
        tl.float32
    )  # [BK]
    value = tl.load(v_ptr + row * v_stride_t + head * v_stride_h + dv_offsets, mask=dv_mask, other=0.0).to(
        tl.float32
    )  # [BV]
    decay = tl.load(g_ptr + row * g_stride_t + head).to(tl.float32)
    beta = tl.load(beta_ptr + row * beta_stride_t + head).to(tl.float32)
    return _delta_step(state, key, value, decay, beta)


@triton.jit
def _recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    out_ptr,
    state_ptr,
    log_k_ptr,
    log_v_ptr,
    log_g_ptr,
    log_beta_ptr,
    query_start_ptr,
    slots_ptr,
    fold_ptr,
    speculative_ptr,
    ancestors_ptr,
    flags_ptr,
    fold_rows_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    g_stride_t,
    beta_stride_t,
    out_stride_t,
    out_stride_h,
    state_stride_slot,
    state_stride_h,
    state_stride_k,
    log_k_stride_slot,
    log_k_stride_row,
    log_k_stride_h,
    log_v_stride_slot,
    log_v_stride_row,
    log_v_stride_h,
    log_g_stride_slot,
    log_g_stride_row,
    log_beta_stride_slot,
    log_beta_stride_row,
    fold_rows_stride,
    HEAD_RATIO: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_LOG: tl.constexpr,
    ROUND_ROWS: tl.constexpr,
    HAS_TREE: tl.constexpr,
):
    pdl.wait_for_previous()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // HEAD_RATIO
    first_row = tl.load(query_start_ptr + seq).to(tl.int64)
    end_row = tl.load(query_start_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    num_fold = tl.load(fold_ptr + seq)
    speculative = tl.load(speculative_ptr + seq) != 0

    dk_offsets = tl.arange(0, BK)
    dk_mask = dk_offsets < DK
    dv_offsets = tl.program_id(2) * BV + tl.arange(0, BV)
    dv_mask = dv_offsets < DV
    block_mask = dk_mask[:, None] & dv_mask[None, :]  # [BK, BV]
    state_ptrs = (
        state_ptr
        + slot * state_stride_slot
        + head * state_stride_h
        + dk_offsets[:, None] * state_stride_k
        + dv_offsets[None, :]
    )  # [BK, BV]
    state = tl.load(state_ptrs, mask=block_mask, other=0.0).to(tl.float32)  # [BK, BV]

    if HAS_LOG:
        log_row = tl.zeros((), dtype=tl.int32)
        while log_row < num_fold:
            if HAS_TREE:
                replayed = tl.load(fold_rows_ptr + seq * fold_rows_stride + log_row)  # the log row of fold step log_row
            else:
                replayed = log_row
            key = tl.load(
                log_k_ptr
                + slot * log_k_stride_slot
                + replayed * log_k_stride_row
                + key_head * log_k_stride_h
                + dk_offsets,
                mask=dk_mask,
                other=0.0,
            ).to(tl.float32)
            value = tl.load(
                log_v_ptr + slot * log_v_stride_slot + replayed * log_v_stride_row + head * log_v_stride_h + dv_offsets,
                mask=dv_mask,
                other=0.0,
            ).to(tl.float32)
            decay = tl.load(log_g_ptr + slot * log_g_stride_slot + replayed * log_g_stride_row + head).to(tl.float32)
            beta = tl.load(log_beta_ptr + slot * log_beta_stride_slot + replayed * log_beta_stride_row + head).to(
                tl.float32
            )
            state = _delta_step(state, key, value, decay, beta)
            if ROUND_ROWS:  # as a run of single-row steps stores it
                state = state.to(state_ptr.dtype.element_ty).to(tl.float32)
            log_row += 1
    # The reference writes the folded state, then reads it back: round it to the storage dtype.
    state = state.to(state_ptr.dtype.element_ty).to(tl.float32)
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=block_mask & speculative & (num_fold > 0))

    row = first_row
    while row < end_row:
        if HAS_TREE:
            flags = tl.load(flags_ptr + row)
            keeps = (speculative == 0) | ((flags & KEEP) != 0)  # other sequences' rows are chains
            if speculative & ((flags & RESTART) != 0):
                # The parent is not the state held: rebuild it from the folded state along the row's ancestors.
                tl.debug_barrier()  # the folded state stored above is visible to every thread
                state = tl.load(state_ptrs, mask=block_mask, other=0.0).to(tl.float32)
                ancestors = tl.load(ancestors_ptr + row)  # bit j: row first_row + j is the row or an ancestor
                ancestor = first_row
                while ancestor < row:
                    if ((ancestors >> (ancestor - first_row)) & 1) != 0:
                        state = _row_step(
                            state,
                            ancestor,
                            key_head,
                            head,
                            dk_offsets,
                            dk_mask,
                            dv_offsets,
                            dv_mask,
                            k_ptr,
                            v_ptr,
                            g_ptr,
                            beta_ptr,
                            k_stride_t,
                            k_stride_h,
                            v_stride_t,
                            v_stride_h,
                            g_stride_t,
                            beta_stride_t,
                        )
                        if ROUND_ROWS:
                            state = state.to(state_ptr.dtype.element_ty).to(tl.float32)
                    ancestor += 1
        query = tl.load(q_ptr + row * q_stride_t + key_head * q_stride_h + dk_offsets, mask=dk_mask, other=0.0).to(
            tl.float32
        )  # [BK]
        after = _row_step(
            state,
            row,
            key_head,
            head,
            dk_offsets,
            dk_mask,
            dv_offsets,
            dv_mask,
            k_ptr,
            v_ptr,
            g_ptr,
            beta_ptr,
            k_stride_t,
            k_stride_h,
            v_stride_t,
            v_stride_h,
            g_stride_t,
            beta_stride_t,
        )  # [BK, BV]
        output = tl.sum(after * query[:, None], axis=0)  # [BV]
        tl.store(
            out_ptr + row * out_stride_t + head * out_stride_h + dv_offsets,
            output.to(out_ptr.dtype.element_ty),
            mask=dv_mask,
        )
        if ROUND_ROWS:
            after = after.to(state_ptr.dtype.element_ty).to(tl.float32)
        if HAS_TREE:
            state = tl.where(keeps, after, state)  # after a leaf the running state stays its parent's
        else:
            state = after
        row += 1
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=block_mask & (speculative == 0))


@triton.jit
def _log_rows_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    log_k_ptr,
    log_v_ptr,
    log_g_ptr,
    log_beta_ptr,
    query_start_ptr,
    slots_ptr,
    speculative_ptr,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    g_stride_t,
    beta_stride_t,
    log_k_stride_slot,
    log_k_stride_row,
    log_k_stride_h,
    log_v_stride_slot,
    log_v_stride_row,
    log_v_stride_h,
    log_g_stride_slot,
    log_g_stride_row,
    log_beta_stride_slot,
    log_beta_stride_row,
    HEAD_RATIO: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    """Row `i` of speculative sequence `seq`, value head `head`: its v, g, beta (and, for the first value
    head of a group, its key head's k) go to log[slot, i]."""
    pdl.wait_for_previous()
    log_row = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    first_row = tl.load(query_start_ptr + seq).to(tl.int64)
    num_rows = tl.load(query_start_ptr + seq + 1).to(tl.int64) - first_row
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    active = (tl.load(speculative_ptr + seq) != 0) & (log_row < num_rows)
    row = first_row + log_row

    dv_offsets = tl.arange(0, BV)
    dv_mask = (dv_offsets < DV) & active
    value = tl.load(v_ptr + row * v_stride_t + head * v_stride_h + dv_offsets, mask=dv_mask, other=0.0)
    tl.store(
        log_v_ptr + slot * log_v_stride_slot + log_row * log_v_stride_row + head * log_v_stride_h + dv_offsets,
        value.to(log_v_ptr.dtype.element_ty),
        mask=dv_mask,
    )
    decay = tl.load(g_ptr + row * g_stride_t + head, mask=active, other=0.0)
    tl.store(
        log_g_ptr + slot * log_g_stride_slot + log_row * log_g_stride_row + head,
        decay.to(log_g_ptr.dtype.element_ty),
        mask=active,
    )
    beta = tl.load(beta_ptr + row * beta_stride_t + head, mask=active, other=0.0)
    tl.store(
        log_beta_ptr + slot * log_beta_stride_slot + log_row * log_beta_stride_row + head,
        beta.to(log_beta_ptr.dtype.element_ty),
        mask=active,
    )

    key_head = head // HEAD_RATIO
    dk_offsets = tl.arange(0, BK)
    dk_mask = (dk_offsets < DK) & active & (head % HEAD_RATIO == 0)
    key = tl.load(k_ptr + row * k_stride_t + key_head * k_stride_h + dk_offsets, mask=dk_mask, other=0.0)
    tl.store(
        log_k_ptr + slot * log_k_stride_slot + log_row * log_k_stride_row + key_head * log_k_stride_h + dk_offsets,
        key.to(log_k_ptr.dtype.element_ty),
        mask=dk_mask,
    )


def _is_plain_prefill(layout: SeqLayout, device: torch.device, dtype: torch.dtype) -> bool:
    """A 16-bit prefill pass (never captured, so host lists may be read) with nothing to log or fold, on CUDA.
    float32 models keep the recurrent kernel: fla's chunk kernel multiplies in TF32."""
    return (
        device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and layout.max_query_len > PREFILL_MIN_QUERY_LEN
        and not any(layout.speculative)
        and not any(layout.fold)
    )


def _chunked_prefill(q, k, v, g, beta, state, layout: SeqLayout) -> torch.Tensor:
    """fla's chunk kernel over all sequences (varlen, batch 1); states gathered from and scattered to slots."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    slots = layout.slots_t
    initial = state.index_select(0, slots).float()  # [B, Hv, Dk, Dv]
    out, final = chunk_gated_delta_rule(
        q.to(v.dtype)[None],
        k.to(v.dtype)[None],
        v[None],
        g.float()[None],
        beta.to(v.dtype)[None],
        scale=1.0,
        initial_state=initial,
        output_final_state=True,
        cu_seqlens=layout.query_start_long(),
        chunk_indices=layout.chunk_indices(FLA_CHUNK_ROWS),
    )  # out [1, T, Hv, Dv]
    state.index_copy_(0, slots, final.to(state.dtype))
    return out[0]


def _log_strides(log: GDNLog) -> tuple[int, ...]:
    return (*log.k.stride()[:3], *log.v.stride()[:3], *log.g.stride()[:2], *log.beta.stride()[:2])


def gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv]
    beta: torch.Tensor,  # [T, Hv]
    state: torch.Tensor,  # [num_slots, Hv, Dk, Dv], updated in place
    layout: SeqLayout,
    log: GDNLog | None = None,  # needed when a sequence is speculative or folds
) -> torch.Tensor:  # [T, Hv, Dv]
    num_tokens, num_key_heads, key_dim = q.shape
    _, num_value_heads, value_dim = v.shape
    assert num_value_heads % num_key_heads == 0 and key_dim <= MAX_KEY_DIM
    assert all(t.stride(-1) == 1 for t in (q, k, v, g, beta, state)), "last dims must be contiguous"
    if _is_plain_prefill(layout, q.device, v.dtype):
        return _chunked_prefill(q, k, v, g, beta, state, layout)

    out = torch.empty((num_tokens, num_value_heads, value_dim), dtype=v.dtype, device=v.device)  # [T, Hv, Dv]
    has_log = log is not None
    if has_log:
        assert all(t.stride(-1) == 1 for t in (log.k, log.v, log.g, log.beta))
        log_tensors, log_strides = (log.k, log.v, log.g, log.beta), _log_strides(log)
    else:
        log_tensors, log_strides = (state,) * 4, (0,) * 10
    tree = layout.tree
    if tree is not None:
        tree_tensors, fold_rows_stride = (tree.ancestors_t, tree.flags_t, tree.fold_rows_t), tree.fold_rows_t.stride(0)
    else:
        tree_tensors, fold_rows_stride = (layout.query_start,) * 3, 0
    head_ratio = num_value_heads // num_key_heads
    key_block = triton.next_power_of_2(key_dim)
    value_block = min(VALUE_BLOCK, triton.next_power_of_2(value_dim))
    grid = (layout.num_seqs, num_value_heads, triton.cdiv(value_dim, value_block))
    _recurrent_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        out,
        state,
        *log_tensors,
        layout.query_start,
        layout.slots_t,
        layout.fold_t,
        layout.speculative_t,
        *tree_tensors,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        out.stride(0),
        out.stride(1),
        state.stride(0),
        state.stride(1),
        state.stride(2),
        *log_strides,
        fold_rows_stride,
        HEAD_RATIO=head_ratio,
        DK=key_dim,
        DV=value_dim,
        BK=key_block,
        BV=value_block,
        HAS_LOG=has_log,
        ROUND_ROWS=state.dtype != torch.float32,
        HAS_TREE=tree is not None,
        num_warps=RECURRENT_WARPS,
        num_stages=RECURRENT_STAGES,
        **pdl.LAUNCH,
    )
    if has_log:
        log_rows = min(layout.max_query_len, log.k.shape[1])
        _log_rows_kernel[(log_rows, layout.num_seqs, num_value_heads)](
            k,
            v,
            g,
            beta,
            *log_tensors,
            layout.query_start,
            layout.slots_t,
            layout.speculative_t,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            g.stride(0),
            beta.stride(0),
            *log_strides,
            HEAD_RATIO=head_ratio,
            DK=key_dim,
            DV=value_dim,
            BK=key_block,
            BV=triton.next_power_of_2(value_dim),
            **pdl.LAUNCH,
        )
    return out
