"""Triton GDN kernels (gated delta rule, causal conv1d, gates) against their torch references, on fresh
random inputs: outputs, final states, windows and replay logs are compared separately, with
slots that are not 0..B-1 and untouched neighbouring slots that must keep their contents. Tree passes
(`layout.tree`) mix tree, chain, decode and folding sequences, and a tree's rows are checked against its
root-to-row paths run as chains."""

import pytest
import torch

from deltaspec.ops import conv as conv_reference
from deltaspec.ops import gdn as gdn_reference
from deltaspec.ops.gdn import GDNLog
from deltaspec.ops.layout import SeqLayout
from tests.tree_helpers import TREE, random_parents, root_path

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


def _layout(lens, slots, device, fold=None, speculative=None, parents=None, fold_rows=None, log_rows=LOG_ROWS):
    return SeqLayout.build(
        lens, lens, slots, device, fold, speculative, parents=parents, fold_rows=fold_rows, log_rows=log_rows
    )


def _assert_close(actual, expected, what, tol):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- gated delta rule


def _gdn_inputs(
    num_tokens, hk, hv, dk, dv, device, dtype=torch.float32, state_dtype=torch.float32, seed=0, log_rows=LOG_ROWS
):
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
        k=torch.nn.functional.normalize(randn(NUM_SLOTS, log_rows, hk, dk), dim=-1),
        v=randn(NUM_SLOTS, log_rows, hv, dv),
        g=torch.nn.functional.logsigmoid(randn(NUM_SLOTS, log_rows, hv) + 2.0),
        beta=torch.sigmoid(randn(NUM_SLOTS, log_rows, hv)),
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
    parents=None,
    fold_rows=None,
    log_rows=LOG_ROWS,
):
    q, k, v, g, beta, state, log = _gdn_inputs(sum(lens), hk, hv, dk, dv, device, dtype, state_dtype, seed, log_rows)
    layout = _layout(lens, slots, device, fold, speculative, parents, fold_rows, log_rows)
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


# A tree pass: a tree that folds 2 rows, a speculative chain, a decode row, a random tree that folds the path
# [0, 2, 5] of its last tree, and a plain 4-row sequence that folds [1, 3].
TREE_PASS = dict(
    lens=[8, 3, 1, 6, 4],
    slots=[4, 8, 0, 2, 6],
    fold=[2, 0, 1, 3, 2],
    speculative=[True, True, False, True, False],
    parents=[TREE, None, None, random_parents(6, seed=1), None],
    fold_rows=[None, None, None, [0, 2, 5], [1, 3]],
)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_gdn_tree_pass(kernel_device, state_dtype):
    """Each tree row continues its parent's state (restarting from the folded state along its ancestors, each
    rounded as a row is for a bf16 state), folds replay their fold rows, and chains stay chains."""
    tol = FP32 if state_dtype == torch.float32 else BF16
    _check_gdn(kernel_device, **TREE_PASS, state_dtype=state_dtype, tol=tol, state_tol=tol, seed=5)


def test_gdn_large_tree_beside_a_long_sequence(kernel_device):
    """A random 40-row tree (restarts replaying long paths) in a pass with a 70-row plain sequence."""
    _check_gdn(
        kernel_device,
        [70, 40],
        [2, 5],
        fold=[0, 3],
        speculative=[False, True],
        parents=[None, random_parents(40, seed=2)],
        fold_rows=[None, [4, 1, 7]],
        log_rows=40,
        hk=1,
        hv=2,
        dk=8,
        dv=8,
        tol={"atol": 1e-4, "rtol": 1e-4},
        state_tol={"atol": 1e-4, "rtol": 1e-4},
    )


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("implementation", ["reference", "kernel"])
def test_gdn_tree_rows_are_their_paths_as_chains(kernel_device, implementation, state_dtype):
    """Row i of a tree gives what the last row of its root-to-i path gives, verified as a chain from the same
    state and fold (one chain per row, each in its own slot holding a copy of the tree's)."""
    rule = gdn_reference.gated_delta_rule if implementation == "reference" else gdn_kernels.gated_delta_rule
    q, k, v, g, beta, state, log = _gdn_inputs(len(TREE), 2, 4, 16, 16, kernel_device, state_dtype=state_dtype, seed=4)
    chains = len(TREE)
    state[1 : 1 + chains] = state[0]
    for name in ("k", "v", "g", "beta"):
        getattr(log, name)[1 : 1 + chains] = getattr(log, name)[0]
    chain_state, chain_log = state.clone(), _clone_log(log)
    tree = rule(q, k, v, g, beta, state, _layout([chains], [0], kernel_device, [2], [True], [TREE], [[0, 1]]), log)
    paths = [root_path(TREE, row) for row in range(chains)]
    rows = torch.tensor([row for path in paths for row in path], device=kernel_device)
    layout = _layout([len(p) for p in paths], list(range(1, 1 + chains)), kernel_device, [2] * chains, [True] * chains)
    out = rule(q[rows], k[rows], v[rows], g[rows], beta[rows], chain_state, layout, chain_log)
    last_rows = layout.query_start[1:].long() - 1
    torch.testing.assert_close(tree, out[last_rows], atol=1e-6, rtol=1e-6)
    assert torch.equal(state[0], chain_state[1]), "the folded state the tree pass wrote"


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
    parents=None,
    fold_rows=None,
    log_rows=LOG_ROWS,
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), channels, generator=gen).to(device=device, dtype=dtype)  # [T, C]
    weight = (torch.randn(channels, kernel_size, generator=gen) * 0.5).to(device=device, dtype=dtype)  # [C, K]
    conv_state = torch.randn(NUM_SLOTS, kernel_size - 1, channels, generator=gen).to(device=device, dtype=state_dtype)
    log = torch.randn(NUM_SLOTS, log_rows, channels, generator=gen).to(device=device, dtype=state_dtype)
    layout = _layout(lens, slots, device, fold, speculative, parents, fold_rows, log_rows)
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


def test_conv_tree_pass(kernel_device):
    """Tree rows convolve their ancestors' rows (reaching into the folded window from deep rows), folds shift
    in their fold rows, chains stay chains."""
    _check_conv(kernel_device, **TREE_PASS, seed=5)


def test_conv_large_tree_beside_a_long_sequence(kernel_device):
    """A random 40-row tree, whose rows past the first 32 still reach the window, beside a 70-row sequence."""
    parents = random_parents(40, seed=3)
    parents[35], parents[38] = 0, 1  # rows 1 and 2 deep: their taps reach 2 and 1 rows into the window
    _check_conv(
        kernel_device,
        [70, 40, 1],
        [3, 5, 1],
        fold=[2, 3, 1],
        speculative=[False, True, False],
        parents=[None, parents, None],
        fold_rows=[None, [6, 0, 2], None],
        log_rows=40,
        channels=40,
    )


@pytest.mark.parametrize("implementation", ["reference", "kernel"])
def test_conv_tree_rows_are_their_paths_as_chains(kernel_device, implementation):
    """Row i of a tree gives what the last row of its root-to-i path gives, verified as a chain (each chain in its
    own slot holding a copy of the tree's window and log)."""
    conv = conv_reference.causal_conv1d if implementation == "reference" else conv_kernels.causal_conv1d
    gen = torch.Generator().manual_seed(6)
    chains, channels = len(TREE), 24
    x = torch.randn(chains, channels, generator=gen).to(kernel_device)  # [T, C]
    weight = torch.randn(channels, 4, generator=gen).to(kernel_device)  # [C, K]
    conv_state = torch.randn(1, 3, channels, generator=gen).repeat(NUM_SLOTS, 1, 1).to(kernel_device)
    log = torch.randn(1, LOG_ROWS, channels, generator=gen).repeat(NUM_SLOTS, 1, 1).to(kernel_device)
    chain_state, chain_log = conv_state.clone(), log.clone()
    tree = conv(x, weight, conv_state, _layout([chains], [0], kernel_device, [2], [True], [TREE], [[0, 1]]), log)
    paths = [root_path(TREE, row) for row in range(chains)]
    rows = torch.tensor([row for path in paths for row in path], device=kernel_device)
    layout = _layout([len(p) for p in paths], list(range(1, 1 + chains)), kernel_device, [2] * chains, [True] * chains)
    out = conv(x[rows], weight, chain_state, layout, chain_log)
    torch.testing.assert_close(tree, out[layout.query_start[1:].long() - 1], atol=1e-6, rtol=1e-6)
    assert torch.equal(conv_state[0], chain_state[1]), "the folded window the tree pass wrote"


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
