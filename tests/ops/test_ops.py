"""Torch reference ops against their definitions: the recurrence row by row, a plain conv, dense
attention. These references are the oracles the GPU kernels will be tested against."""

import torch
import torch.nn.functional as F

from deltaspec.ops.attention import paged_attention, write_kv
from deltaspec.ops.conv import causal_conv1d
from deltaspec.ops.gdn import gated_delta_rule
from deltaspec.ops.layout import SeqLayout
from deltaspec.ops.norms import l2_norm

torch.manual_seed(0)


def lay(lens, slots, fold=None, speculative=None, context_lens=None, block_tables=None):
    return SeqLayout.build(
        lens, context_lens or lens, slots, "cpu", fold=fold, speculative=speculative, block_tables=block_tables
    )


def naive_gdn(q, k, v, g, beta, state):
    """DESIGN §1 step 5, one row at a time, one head at a time."""
    r = v.shape[1] // q.shape[1]
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        for h in range(v.shape[1]):
            s = state[h] * g[t, h].exp()
            u = s.T @ k[t, h // r]
            s = s + torch.outer(k[t, h // r], beta[t, h] * (v[t, h] - u))
            out[t, h] = s.T @ q[t, h // r]
            state[h] = s
    return out


def random_gdn_inputs(rows, hk=2, hv=4, dk=8, dv=6):
    q = l2_norm(torch.randn(rows, hk, dk, dtype=torch.float64)) * dk**-0.5
    k = l2_norm(torch.randn(rows, hk, dk, dtype=torch.float64))
    v = torch.randn(rows, hv, dv, dtype=torch.float64)
    g = -torch.rand(rows, hv, dtype=torch.float64) * 2
    beta = torch.rand(rows, hv, dtype=torch.float64)
    return q, k, v, g, beta


def test_gated_delta_rule_matches_row_by_row_recurrence_across_chunks():
    lens, slots = [1, 150, 64, 1, 3], [3, 0, 4, 1, 2]
    q, k, v, g, beta = random_gdn_inputs(sum(lens))
    state = torch.randn(5, 4, 8, 6, dtype=torch.float64)
    expected_state = state.clone()
    expected = torch.empty_like(v)
    start = 0
    for length, slot in zip(lens, slots):
        rows = slice(start, start + length)
        expected[rows] = naive_gdn(q[rows], k[rows], v[rows], g[rows], beta[rows], expected_state[slot])
        start += length
    out = gated_delta_rule(q, k, v, g, beta, state, lay(lens, slots))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, expected_state, rtol=0, atol=1e-12)


def test_gated_delta_rule_float32_state_keeps_float32():
    q, k, v, g, beta = (t.float() for t in random_gdn_inputs(70))
    state = torch.zeros(1, 4, 8, 6)
    out = gated_delta_rule(q, k, v.bfloat16(), g, beta, state, lay([70], [0]))
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32 and state.abs().sum() > 0


def test_causal_conv1d_carries_the_window_between_pieces():
    channels, kernel, total = 5, 4, 23
    x = torch.randn(total, channels, dtype=torch.float64)
    weight = torch.randn(channels, kernel, dtype=torch.float64)
    expected = F.silu(F.conv1d(x.T[None], weight[:, None, :], padding=kernel - 1, groups=channels)[0, :, :total].T)
    conv_state = torch.zeros(2, kernel - 1, channels, dtype=torch.float64)
    pieces, got, start = [1, 2, 9, 1, 10], [], 0
    for length in pieces:
        got.append(causal_conv1d(x[start : start + length], weight, conv_state, lay([length], [1])))
        start += length
    torch.testing.assert_close(torch.cat(got), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(conv_state[1], x[-(kernel - 1) :], rtol=0, atol=0)
    assert conv_state[0].abs().sum() == 0  # the other slot is untouched


def test_paged_attention_matches_dense_causal_attention_with_scattered_pages():
    hq, hkv, d, block_size = 4, 2, 8, 4
    lens_cached, lens_new = [0, 9], [6, 3]
    k_cache = torch.zeros(16, block_size, hkv, d, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.tensor([[7, 2, 0], [5, 11, 1]])
    keys = [torch.randn(c + n, hkv, d, dtype=torch.float64) for c, n in zip(lens_cached, lens_new)]
    values = [torch.randn_like(t) for t in keys]
    for b, (c, n) in enumerate(zip(lens_cached, lens_new)):
        pos = torch.arange(c + n)
        slots = tables[b][pos // block_size] * block_size + pos % block_size
        write_kv(keys[b], values[b], k_cache, v_cache, slots)
    q = torch.randn(sum(lens_new), hq, d, dtype=torch.float64)
    out = paged_attention(
        q,
        k_cache,
        v_cache,
        lay(
            lens_new, [0, 1], context_lens=[c + n for c, n in zip(lens_cached, lens_new)], block_tables=tables.tolist()
        ),
        d**-0.5,
    )
    start = 0
    for b, (c, n) in enumerate(zip(lens_cached, lens_new)):
        qb = q[start : start + n].transpose(0, 1)  # [Hq, n, D]
        kb = keys[b].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        vb = values[b].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        mask = torch.arange(c + n)[None, :] <= torch.arange(c, c + n)[:, None]
        want = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(out[start : start + n], want, rtol=0, atol=1e-12)
        start += n


def test_speculative_rows_are_logged_and_accepted_rows_replayed_exactly():
    """A verify pass leaves the state alone; folding its first a rows next time equals having run them."""
    from deltaspec.ops.gdn import GDNLog

    q, k, v, g, beta = random_gdn_inputs(12)
    state = torch.randn(3, 4, 8, 6, dtype=torch.float64)
    log = GDNLog(
        k=torch.zeros(3, 8, 2, 8, dtype=torch.float64),
        v=torch.zeros(3, 8, 4, 6, dtype=torch.float64),
        g=torch.zeros(3, 8, 4, dtype=torch.float64),
        beta=torch.zeros(3, 8, 4, dtype=torch.float64),
    )
    plain_state = state.clone()
    plain = gated_delta_rule(q, k, v, g, beta, plain_state, lay([5, 7], [2, 0]))  # rows 0-4: slot 2, 5-11: slot 0
    spec_state = state.clone()
    spec = gated_delta_rule(
        q[:5], k[:5], v[:5], g[:5], beta[:5], spec_state, lay([5], [2], speculative=[True]), log=log
    )
    torch.testing.assert_close(spec, plain[:5], rtol=0, atol=1e-12)
    torch.testing.assert_close(spec_state, state, rtol=0, atol=0)  # nothing advanced
    for accepted in (0, 3, 5):
        folded = spec_state.clone()
        rest = gated_delta_rule(q[5:], k[5:], v[5:], g[5:], beta[5:], folded, lay([7], [2], fold=[accepted]), log=log)
        expected_state = state.clone()
        if accepted:
            gated_delta_rule(
                q[:accepted],
                k[:accepted],
                v[:accepted],
                g[:accepted],
                beta[:accepted],
                expected_state,
                lay([accepted], [2]),
            )
        expected = gated_delta_rule(q[5:], k[5:], v[5:], g[5:], beta[5:], expected_state, lay([7], [2]))
        torch.testing.assert_close(rest, expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(folded, expected_state, rtol=0, atol=1e-12)


def test_conv_window_is_logged_and_replayed():
    channels, kernel = 5, 4
    x = torch.randn(9, channels, dtype=torch.float64)
    weight = torch.randn(channels, kernel, dtype=torch.float64)
    start = torch.randn(1, kernel - 1, channels, dtype=torch.float64)
    log = torch.zeros(1, 8, channels, dtype=torch.float64)
    for accepted in (0, 1, 4):
        window = start.clone()
        spec = causal_conv1d(x[:4], weight, window, lay([4], [0], speculative=[True]), log=log)
        torch.testing.assert_close(window, start, rtol=0, atol=0)
        out = causal_conv1d(x[4:], weight, window, lay([5], [0], fold=[accepted]), log=log)
        reference = start.clone()
        plain = causal_conv1d(torch.cat((x[:accepted], x[4:])), weight, reference, lay([accepted + 5], [0]))
        torch.testing.assert_close(out, plain[accepted:], rtol=0, atol=1e-12)
        torch.testing.assert_close(window, reference, rtol=0, atol=0)
        torch.testing.assert_close(spec, causal_conv1d(x[:4], weight, start.clone(), lay([4], [0])), rtol=0, atol=0)


def test_layout_chunk_indices_label_every_chunk_with_its_sequence_and_position():
    layout = SeqLayout.build([130, 64, 1, 65], [130, 64, 1, 65], [0, 1, 2, 3], "cpu")
    chunks = layout.chunk_indices(64)
    assert chunks.dtype == torch.long
    expected = [[0, 0], [0, 1], [0, 2], [1, 0], [2, 0], [3, 0], [3, 1]]
    assert chunks.tolist() == expected
    assert layout.chunk_indices(64) is chunks  # made once per pass, shared by the layers
    assert layout.chunk_indices(16).shape == (9 + 4 + 1 + 5, 2)
    assert layout.query_start_long().tolist() == [0, 130, 194, 195, 260]
    assert layout.query_start_long() is layout.query_start_long()
