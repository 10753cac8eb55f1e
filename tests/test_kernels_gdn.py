"""Triton GDN kernels (gated delta rule, causal conv1d, gates) against their torch references, on fresh
random inputs: outputs, final states, windows and replay logs are compared separately, with
slots that are not 0..B-1 and untouched neighbouring slots that must keep their contents."""

import pytest
import torch

from deltaspec.ops import conv as conv_reference
from deltaspec.ops import gdn as gdn_reference
from deltaspec.ops.gdn import GDNLog
from deltaspec.ops.layout import SeqLayout

pytestmark = [pytest.mark.gpu, pytest.mark.kernel]

pytest.importorskip("triton")

from deltaspec.ops.triton import conv as conv_kernels  # noqa: E402 - only once triton imports
from deltaspec.ops.triton import gdn as gdn_kernels  # noqa: E402
from deltaspec.ops.triton import gdn_gates as gates_kernels  # noqa: E402

NUM_SLOTS = 9
LOG_ROWS = 8
FP32 = {"atol": 2e-5, "rtol": 1e-5}
BF16 = {"atol": 3e-2, "rtol": 3e-2}
RELATIVE = {"atol": 1e-30, "rtol": 2e-5}
# Values the kernel only rounds to bfloat16 (windows, beta): exact on CUDA, but Triton's interpreter
# truncates float32 -> bfloat16 where the GPU rounds to nearest even, so allow one bfloat16 step.
BF16_ONE_STEP = {"atol": 1e-2, "rtol": 8e-3}


def _layout(lens, slots, device, fold=None, speculative=None) -> SeqLayout:
    return SeqLayout.build(lens, lens, slots, device, fold=fold, speculative=speculative)


def _assert_close(actual, expected, what, tol):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- gated delta rule


def _gdn_inputs(num_tokens, hk, hv, dk, dv, device, dtype=torch.float32, state_dtype=torch.float32, seed=0):
    """Random post-gates inputs, a random state for every slot and a random replay log."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = torch.nn.functional.normalize(randn(num_tokens, hk, dk), dim=-1) * dk**-0.5  # [T, Hk, Dk]
    k = torch.nn.functional.normalize(randn(num_tokens, hk, dk), dim=-1)  # [T, Hk, Dk]
    v = randn(num_tokens, hv, dv).to(dtype)  # [T, Hv, Dv]
    g = torch.nn.functional.logsigmoid(randn(num_tokens, hv) + 2.0)  # [T, Hv]
    beta = torch.sigmoid(randn(num_tokens, hv)).to(dtype)  # [T, Hv]
    state = (randn(NUM_SLOTS, hv, dk, dv) * 0.3).to(state_dtype)  # [S, Hv, Dk, Dv]
    log = GDNLog(
        k=torch.nn.functional.normalize(randn(NUM_SLOTS, LOG_ROWS, hk, dk), dim=-1),
        v=randn(NUM_SLOTS, LOG_ROWS, hv, dv),
        g=torch.nn.functional.logsigmoid(randn(NUM_SLOTS, LOG_ROWS, hv) + 2.0),
        beta=torch.sigmoid(randn(NUM_SLOTS, LOG_ROWS, hv)),
    )
    return (
        q.to(device),
        k.to(device),
        v.to(device),
        g.to(device),
        beta.to(device),
        state.to(device),
        GDNLog(*(t.to(device) for t in (log.k, log.v, log.g, log.beta))),
    )


def _clone_log(log: GDNLog) -> GDNLog:
    return GDNLog(log.k.clone(), log.v.clone(), log.g.clone(), log.beta.clone())


def _check_gdn(
    device,
    lens,
    slots,
    fold=None,
    speculative=None,
    hk=2,
    hv=4,
    dk=16,
    dv=16,
    dtype=torch.float32,
    state_dtype=torch.float32,
    with_log=True,
    tol=FP32,
    state_tol=FP32,
    seed=0,
):
    q, k, v, g, beta, state, log = _gdn_inputs(sum(lens), hk, hv, dk, dv, device, dtype, state_dtype, seed)
    layout = _layout(lens, slots, device, fold, speculative)
    expected_state, expected_log = state.clone(), _clone_log(log)
    expected = gdn_reference.gated_delta_rule(
        q, k, v, g, beta, expected_state, layout, expected_log if with_log else None
    )
    original_state = state.clone()
    out = gdn_kernels.gated_delta_rule(q, k, v, g, beta, state, layout, log if with_log else None)

    _assert_close(out, expected, "output", tol)
    for slot in range(NUM_SLOTS):
        if slot not in slots:
            assert torch.equal(state[slot], original_state[slot]), f"untouched slot {slot} was written"
    _assert_close(state, expected_state, "state", state_tol)
    for name in ("k", "v", "g", "beta"):
        _assert_close(getattr(log, name), getattr(expected_log, name), f"log.{name}", FP32)


def test_gdn_decode(kernel_device):
    _check_gdn(kernel_device, [1, 1, 1], [5, 2, 7], with_log=False)


def test_gdn_multi_row_sequences_with_fold(kernel_device):
    _check_gdn(kernel_device, [1, 5, 3], [6, 1, 3], fold=[0, 3, 2])


def test_gdn_verify_logs_rows_and_keeps_folded_state(kernel_device):
    """Speculative sequences: the log rows they fold are the rows they overwrite; the state written is
    the folded one (slot 4), or nothing at all when there is nothing to fold (slot 8)."""
    _check_gdn(kernel_device, [4, 3, 1, 2], [4, 8, 0, 2], fold=[2, 0, 1, 3], speculative=[True, True, False, True])


def test_gdn_speculative_without_fold_leaves_state(kernel_device):
    q, k, v, g, beta, state, log = _gdn_inputs(3, 2, 4, 16, 16, kernel_device)
    layout = _layout([3], [6], kernel_device, speculative=[True])
    before = state.clone()
    gdn_kernels.gated_delta_rule(q, k, v, g, beta, state, layout, log)
    assert torch.equal(state, before)
    torch.testing.assert_close(log.v[6, :3], v, atol=0, rtol=0)
    torch.testing.assert_close(log.k[6, :3], k, atol=0, rtol=0)


def test_gdn_realistic_head_shape(kernel_device):
    _check_gdn(
        kernel_device,
        [1, 3, 2],
        [3, 7, 1],
        fold=[1, 2, 0],
        speculative=[False, True, False],
        hk=2,
        hv=4,
        dk=128,
        dv=128,
        tol={"atol": 5e-5, "rtol": 1e-4},
        state_tol={"atol": 5e-5, "rtol": 1e-4},
    )


def test_gdn_grouped_heads_ratio_three_and_odd_dims(kernel_device):
    _check_gdn(kernel_device, [2, 1], [8, 3], fold=[1, 0], speculative=[True, False], hk=1, hv=3, dk=12, dv=20)


def test_gdn_bfloat16(kernel_device):
    _check_gdn(
        kernel_device,
        [1, 4, 2],
        [2, 6, 5],
        fold=[2, 0, 1],
        speculative=[False, True, False],
        dtype=torch.bfloat16,
        tol=BF16,
    )


def test_gdn_bfloat16_state(kernel_device):
    _check_gdn(
        kernel_device,
        [1, 3],
        [4, 1],
        fold=[3, 1],
        speculative=[False, True],
        dtype=torch.bfloat16,
        state_dtype=torch.bfloat16,
        tol=BF16,
        state_tol=BF16,
    )


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("implementation", ["reference", "kernel"])
def test_gdn_narrow_state_speculative_rows_are_single_steps(kernel_device, implementation, state_dtype):
    """With a bf16 / fp16 state, verifying 3 rows and then folding them (with one new row) gives exactly what 4
    single-row steps give: the same outputs and the same stored state, bit for bit (each row rounds the state
    as a step's store does), so speculative decoding keeps plain decoding's tokens."""
    rule = gdn_reference.gated_delta_rule if implementation == "reference" else gdn_kernels.gated_delta_rule
    q, k, v, g, beta, state, log = _gdn_inputs(4, 2, 4, 16, 16, kernel_device, state_dtype=state_dtype, seed=3)
    stepped = state.clone()
    single = [rule(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], stepped,
                   _layout([1], [5], kernel_device)) for i in range(4)]  # fmt: skip
    verified = rule(
        q[:3], k[:3], v[:3], g[:3], beta[:3], state, _layout([3], [5], kernel_device, speculative=[True]), log
    )
    last = rule(q[3:], k[3:], v[3:], g[3:], beta[3:], state, _layout([1], [5], kernel_device, fold=[3]), log)
    assert torch.equal(torch.cat([verified, last]), torch.cat(single))
    assert torch.equal(state, stepped)


def test_gdn_long_mixed_pass_uses_recurrence(kernel_device):
    """max_query_len > 64 with a speculative sequence: the recurrent kernel runs the whole pass."""
    _check_gdn(
        kernel_device,
        [70, 3],
        [2, 5],
        fold=[0, 2],
        speculative=[False, True],
        hk=1,
        hv=2,
        dk=8,
        dv=8,
        tol={"atol": 1e-4, "rtol": 1e-4},
        state_tol={"atol": 1e-4, "rtol": 1e-4},
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's chunk kernel needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_prefill_chunked(kernel_device, dtype):
    loose = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.float32 else {"atol": 6e-2, "rtol": 6e-2}
    _check_gdn(
        kernel_device, [130, 70, 1], [6, 2, 4], hk=2, hv=4, dk=64, dv=64, dtype=dtype, tol=loose, state_tol=loose
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's chunk kernel needs CUDA")
def test_gdn_prefill_chunked_never_waits_for_the_device():
    """A prefill pass runs the chunk kernel once per GDN layer; a host-device synchronization in it (fla builds its
    chunk table from a pageable upload unless given one) stalls the host on every layer and leaves the GPU idle."""
    lens, slots, hk, hv, dk, dv = [130, 70], [1, 3], 2, 4, 64, 64
    rows = sum(lens)
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(rows, hk, dk, generator=gen).cuda().bfloat16() for _ in range(2))
    v = torch.randn(rows, hv, dv, generator=gen).cuda().bfloat16()
    g, beta = -torch.rand(rows, hv, generator=gen).cuda(), torch.rand(rows, hv, generator=gen).cuda().bfloat16()
    state = torch.zeros(NUM_SLOTS, hv, dk, dv, device="cuda")
    layout = _layout(lens, slots, "cuda")
    gdn_kernels.gated_delta_rule(q, k, v, g, beta, state, layout)  # compiles and autotunes first
    layout = _layout(lens, slots, "cuda")  # a new pass: its chunk table is made anew
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _layer in range(3):
            gdn_kernels.gated_delta_rule(q, k, v, g, beta, state, layout)
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ---------------------------------------------------------------- causal conv1d


def _check_conv(
    device,
    lens,
    slots,
    fold=None,
    speculative=None,
    channels=24,
    kernel_size=4,
    dtype=torch.float32,
    state_dtype=torch.float32,
    with_log=True,
    tol=FP32,
    window_tol=FP32,
    seed=0,
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), channels, generator=gen).to(device=device, dtype=dtype)  # [T, C]
    weight = (torch.randn(channels, kernel_size, generator=gen) * 0.5).to(device=device, dtype=dtype)  # [C, K]
    conv_state = torch.randn(NUM_SLOTS, kernel_size - 1, channels, generator=gen).to(device=device, dtype=state_dtype)
    log = torch.randn(NUM_SLOTS, LOG_ROWS, channels, generator=gen).to(device=device, dtype=state_dtype)
    layout = _layout(lens, slots, device, fold, speculative)
    expected_state, expected_log = conv_state.clone(), log.clone()
    expected = conv_reference.causal_conv1d(x, weight, expected_state, layout, expected_log if with_log else None)
    original_state = conv_state.clone()
    out = conv_kernels.causal_conv1d(x, weight, conv_state, layout, log if with_log else None)

    _assert_close(out, expected, "output", tol)
    for slot in range(NUM_SLOTS):
        if slot not in slots:
            assert torch.equal(conv_state[slot], original_state[slot]), f"untouched slot {slot} was written"
    _assert_close(conv_state, expected_state, "window", window_tol)
    _assert_close(log, expected_log, "log", FP32)


def test_conv_decode(kernel_device):
    _check_conv(kernel_device, [1, 1, 1], [5, 2, 7], with_log=False)


def test_conv_short_sequences_keep_old_window_rows(kernel_device):
    _check_conv(kernel_device, [2, 1, 5], [1, 8, 3], with_log=False)


def test_conv_fold_and_speculative(kernel_device):
    """Folds of fewer and more than K-1 rows; speculative sequences that fold (window written) and
    that do not (window untouched); the rows they log overwrite the rows they fold."""
    _check_conv(
        kernel_device,
        [5, 2, 1, 3, 4],
        [0, 4, 8, 2, 6],
        fold=[0, 3, 5, 1, 2],
        speculative=[False, True, True, False, True],
    )


def test_conv_many_channel_blocks(kernel_device):
    _check_conv(kernel_device, [1, 2], [7, 3], fold=[2, 0], speculative=[False, True], channels=3000)


def test_conv_long_sequences_span_row_blocks(kernel_device):
    _check_conv(kernel_device, [150, 70, 2], [3, 5, 1], fold=[0, 4, 1], speculative=[False, False, True], channels=40)


def test_conv_kernel_size_two(kernel_device):
    _check_conv(kernel_device, [3, 1], [2, 6], fold=[2, 1], speculative=[True, False], kernel_size=2)


def test_conv_bfloat16(kernel_device):
    _check_conv(
        kernel_device,
        [1, 4, 2],
        [2, 6, 5],
        fold=[2, 0, 1],
        speculative=[False, True, False],
        dtype=torch.bfloat16,
        tol=BF16,
        window_tol=BF16_ONE_STEP,
    )


def test_conv_bfloat16_rows_float32_window(kernel_device):
    _check_conv(
        kernel_device,
        [1, 2, 3],
        [2, 6, 5],
        fold=[3, 0, 1],
        speculative=[True, False, False],
        dtype=torch.bfloat16,
        state_dtype=torch.float32,
        tol=BF16,
        window_tol=BF16_ONE_STEP,
    )


# ---------------------------------------------------------------- gates


def _check_gates(device, num_tokens, hk, hv, dk, dtype=torch.float32, beta_tol=FP32, seed=0):
    """q, k, a and b are strided views, as the model passes them (splits of wider projections)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(num_tokens, 2 * hk * dk + 3, generator=gen) * 2).to(device=device, dtype=dtype)  # [T, C]
    qkv[1, :dk] *= 1e-3  # a query head whose squared norm is close to the L2 eps
    q, k, _ = torch.split(qkv, [hk * dk, hk * dk, 3], dim=-1)
    q, k = q.view(num_tokens, hk, dk), k.view(num_tokens, hk, dk)
    ba = (torch.randn(num_tokens, 2 * hv, generator=gen) * 3).to(device=device, dtype=dtype)  # [T, 2 Hv]
    ba[0, hv : hv + 3] = torch.tensor([30.0, -12.0, -40.0])  # softplus above its threshold and in its tail
    b, a = torch.split(ba, [hv, hv], dim=-1)
    A_log = torch.randn(hv, generator=gen).to(device)
    dt_bias = torch.randn(hv, generator=gen).to(device=device, dtype=dtype)

    expected = gdn_reference.gdn_gates(q, k, a, b, A_log, dt_bias)
    actual = gates_kernels.gdn_gates(q, k, a, b, A_log, dt_bias)
    for name, got, want in zip(("q", "k", "g", "beta"), actual, expected):
        _assert_close(got, want, name, {"beta": beta_tol, "g": RELATIVE}.get(name, FP32))
        assert got.is_contiguous()


def test_gates_small(kernel_device):
    _check_gates(kernel_device, 5, hk=2, hv=6, dk=12)


def test_gates_realistic_head_shape(kernel_device):
    _check_gates(kernel_device, 3, hk=16, hv=32, dk=128)


def test_gates_bfloat16(kernel_device):
    _check_gates(kernel_device, 4, hk=2, hv=4, dk=16, dtype=torch.bfloat16, beta_tol=BF16_ONE_STEP)
