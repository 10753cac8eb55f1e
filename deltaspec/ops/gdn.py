"""Gated delta rule reference over ragged sequences, with recurrent states read and written by slot.

Contract (kernels keep it): rows of all sequences lie back to back, split as `layout` says
(`deltaspec.ops.layout`); sequence b continues the state `state[slots[b]]` ([Hv, Dk, Dv]) and
leaves its final state there.
Inputs are post-conv, with q and k already L2-normalised and q scaled by Dk^-0.5; value head h
reads key head h // (Hv / Hk). Per row, with decay `g` in log space:

    S <- exp(g) * S;  u = S^T k;  S <- S + k (beta * (v - u))^T;  o = S^T q

Single-row segments use that step directly; longer ones the chunked form below, which is the
same recurrence solved 64 rows at a time. Arithmetic runs in float32 (float64 for float64 inputs
or states); the output has v's dtype.

Speculative rows and the replay log (DESIGN §4): for a sequence marked `speculative`, the rows'
outputs are computed from its state but the state is not advanced; instead each row's inputs
(k, v, g, beta) are written to `log` at that slot, rows 0..n-1. After verification the engine
knows how many of those rows were accepted and passes that count as `fold` in the sequence's
next call, which first replays the accepted log rows onto the state (and writes it), then
processes its new rows. Rejected rows are simply never replayed.

Trees (`layout.tree`): a speculative sequence's rows may form a tree, each row continuing the state after its
parent row (`TreeRows.parents`) instead of the previous row; every row is still logged at its own row. A fold
then replays the log rows `TreeRows.fold_rows[b]` (the accepted path) in order instead of rows 0..fold-1.

A state stored in a narrower dtype than the arithmetic (`--state-dtype bfloat16` / `float16`, or float32 under
float64 arithmetic) is rounded to it each time plain decoding stores it, after every row. So that speculative
decoding gives plain decoding's tokens exactly, speculative rows and the replay of accepted ones take the same
single-row steps with the same rounding after each row (`stepwise`); plain multi-row segments (prompts) round
once, at the end.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltaspec.ops.layout import SeqLayout, chain_parents
from deltaspec.ops.norms import l2_norm


@dataclass
class GDNLog:
    """Inputs of a slot's speculative rows, for one GDN layer: k [S, L, Hk, Dk], v [S, L, Hv, Dv],
    g and beta [S, L, Hv], in the state's compute dtype."""

    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


CHUNK = 64


def _acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _expand_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[L, Hk, D] -> [L, Hv, D]: value head h reads key head h // r."""
    return x.repeat_interleave(num_v_heads // x.shape[1], dim=1)


def recurrent_step(q, k, v, g, beta, state):
    """One row for a batch of states: q, k [N, Hv, Dk]; v [N, Hv, Dv]; g, beta [N, Hv];
    state [N, Hv, Dk, Dv] (not modified). Returns (o [N, Hv, Dv], new state)."""
    state = state * g.exp()[..., None, None]
    u = torch.einsum("nhkv,nhk->nhv", state, k)
    state = state + k[..., :, None] * (beta[..., None] * (v - u))[..., None, :]
    return torch.einsum("nhkv,nhk->nhv", state, q), state


def chunked(q, k, v, g, beta, state):
    """The recurrence over L rows of one sequence: q, k [L, Hv, Dk]; v [L, Hv, Dv]; g, beta [L, Hv];
    state [Hv, Dk, Dv]. Returns (o [L, Hv, Dv], final state).

    Within a chunk with cumulative decay c_i = sum_{j<=i} g_j and corrections d_i = beta_i (v_i - u_i):
      d = (I + A)^-1 beta * (v - exp(c) K S0),  A_ij = beta_i exp(c_i - c_j) k_i.k_j  (j < i)
      o_i = exp(c_i) S0^T q_i + sum_{j<=i} exp(c_i - c_j) (q_i.k_j) d_j
      S  = exp(c_L) S0 + sum_j exp(c_L - c_j) k_j d_j^T
    """
    outputs = []
    for start in range(0, q.shape[0], CHUNK):
        qc, kc, vc = (t[start : start + CHUNK].transpose(0, 1) for t in (q, k, v))  # [Hv, C, D]
        gc, bc = (t[start : start + CHUNK].transpose(0, 1) for t in (g, beta))  # [Hv, C]
        c = gc.cumsum(-1)  # [Hv, C]
        n = c.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (c[:, :, None] - c[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [Hv, C, C]
        a = (bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay).tril(-1)
        rhs = bc[..., None] * (vc - c.exp()[..., None] * (kc @ state))  # [Hv, C, Dv]
        eye = torch.eye(n, dtype=a.dtype, device=a.device)
        d = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        o = c.exp()[..., None] * (qc @ state) + ((qc @ kc.transpose(1, 2)) * decay) @ d
        outputs.append(o.transpose(0, 1))
        tail = (c[:, -1:] - c).exp()  # [Hv, C]
        state = c[:, -1].exp()[:, None, None] * state + (kc * tail[..., None]).transpose(1, 2) @ d
    return torch.cat(outputs, dim=0), state


def stepwise(q, k, v, g, beta, state, stored: torch.dtype):
    """The recurrence over L rows of one sequence as L single-row steps, the state rounded to its `stored` dtype
    after each row as plain decoding stores it: q, k [L, Hv, Dk]; v [L, Hv, Dv]; g, beta [L, Hv]; state
    [Hv, Dk, Dv]. Returns (o [L, Hv, Dv], final state, rounded)."""
    outputs = []
    for i in range(q.shape[0]):
        row = slice(i, i + 1)
        o, state = recurrent_step(q[row], k[row], v[row], g[row], beta[row], state[None])
        outputs.append(o)
        state = state[0].to(stored).to(q.dtype)
    return torch.cat(outputs, dim=0), state


def replay(k, v, g, beta, state, stored: torch.dtype):
    """Advance `state` [Hv, Dk, Dv] over logged rows (k [n, Hk, Dk], v [n, Hv, Dv], g, beta [n, Hv]), rounding it
    to its `stored` dtype after each row."""
    k = _expand_heads(k, v.shape[1])
    for i in range(k.shape[0]):
        state = state * g[i].exp()[:, None, None]
        u = torch.einsum("hkv,hk->hv", state, k[i])
        state = state + k[i][:, :, None] * (beta[i][:, None] * (v[i] - u))[:, None, :]
        state = state.to(stored).to(u.dtype)
    return state


def tree_steps(q, k, v, g, beta, state, parents: list[int], stored: torch.dtype):
    """The recurrence over the L rows of one sequence's tree: row i continues the state after row `parents[i]`
    (the given state for -1), rounded to its `stored` dtype after each row as single-row steps store it. q, k
    [L, Hv, Dk]; v [L, Hv, Dv]; g, beta [L, Hv]; state [Hv, Dk, Dv]. Returns o [L, Hv, Dv]."""
    after: dict[int, torch.Tensor] = {-1: state}
    outputs = []
    for i, parent in enumerate(parents):
        row = slice(i, i + 1)
        o, new_state = recurrent_step(q[row], k[row], v[row], g[row], beta[row], after[parent][None])
        outputs.append(o)
        after[i] = new_state[0].to(stored).to(q.dtype)
    return torch.cat(outputs, dim=0)


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
    acc = _acc_dtype(q.dtype, state.dtype)
    out_dtype = v.dtype
    num_v_heads = v.shape[1]
    query_lens, slots, fold, speculative = layout.query_lens, layout.slots, layout.fold, layout.speculative
    tree = layout.tree
    for b, (n, slot) in enumerate(zip(fold, slots)):
        if n:
            rows = torch.tensor(tree.fold_rows[b] if tree is not None else range(n), device=state.device)
            state[slot].copy_(
                replay(
                    log.k[slot, rows],
                    log.v[slot, rows],
                    log.g[slot, rows],
                    log.beta[slot, rows],
                    state[slot].to(acc),
                    state.dtype,
                )
            )
    for i, slot in enumerate(slots):
        if speculative[i]:
            rows = slice(sum(query_lens[:i]), sum(query_lens[: i + 1]))
            for name, value in (("k", k), ("v", v), ("g", g), ("beta", beta)):
                getattr(log, name)[slot, : query_lens[i]] = value[rows]
    q, k = (_expand_heads(t, num_v_heads).to(acc) for t in (q, k))
    v, g, beta = (t.to(acc) for t in (v, g, beta))
    out = torch.empty(v.shape, dtype=acc, device=v.device)
    starts = layout.row_starts
    single = [i for i, length in enumerate(query_lens) if length == 1 and not speculative[i]]
    if single:
        rows = torch.tensor([starts[i] for i in single], device=q.device)
        slot_index = torch.tensor([slots[i] for i in single], device=q.device)
        o, new_state = recurrent_step(q[rows], k[rows], v[rows], g[rows], beta[rows], state[slot_index].to(acc))
        out[rows] = o
        state.index_copy_(0, slot_index, new_state.to(state.dtype))
    for i, length in enumerate(query_lens):
        if length > 1 or speculative[i]:
            rows = slice(starts[i], starts[i] + length)
            inputs = (q[rows], k[rows], v[rows], g[rows], beta[rows], state[slots[i]].to(acc))
            if speculative[i] and tree is not None and tree.parents[i] != chain_parents(length):
                out[rows] = tree_steps(*inputs, tree.parents[i], state.dtype)
                continue
            if speculative[i] and state.dtype != acc:
                o, new_state = stepwise(*inputs, state.dtype)
            else:
                o, new_state = chunked(*inputs)
            out[rows] = o
            if not speculative[i]:
                state[slots[i]].copy_(new_state)
    return out.to(out_dtype)


def gdn_gates(
    q: torch.Tensor,  # [T, Hk, Dk] post-conv
    k: torch.Tensor,  # [T, Hk, Dk] post-conv
    a: torch.Tensor,  # [T, Hv]
    b: torch.Tensor,  # [T, Hv]
    A_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recurrence's inputs from the projections: q, k L2-normalised (q also scaled by Dk^-0.5)
    and `g = -exp(A_log) * softplus(a + dt_bias)`, all in the compute dtype; `beta = sigmoid(b)` in
    b's dtype. Returns (q, k, g, beta)."""
    acc = _acc_dtype(q.dtype)
    q = l2_norm(q.to(acc)) * q.shape[-1] ** -0.5
    k = l2_norm(k.to(acc))
    g = -A_log.to(acc).exp() * F.softplus(a.to(acc) + dt_bias)
    return q, k, g, b.sigmoid()
