"""The block drafter (DFlash layout): the target layers it reads are transformers' hidden states, its drafts are
those of a from-scratch DFlash forward over them, speculative greedy with it is token-identical to plain greedy
in float64 (every draft length, with n-gram, with prefix caching and rollback), sampling stays lossless, and
every broken drafter is one clear sentence."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from deltaspec import LLM, DeltaspecError, SamplingParams
from deltaspec.execution.batch import Scheduled, build_batch
from deltaspec.model.block_drafter import BlockDrafterConfig, default_target_layers
from deltaspec.spec.drafter import DraftRequest
from tests.engine_helpers import new_sequence
from tests.hf_reference import load_reference
from tests.tiny_models import write_block_drafter, write_checkpoint

PATTERN = [5, 9, 14, 22, 31, 40, 57]
PROMPTS = [PATTERN * 3, [3, 4] + PATTERN * 2 + [8], PATTERN[:4] * 5, [11, 12, 13] * 4 + PATTERN]
TAPS = (0, 2, 3)


@pytest.fixture(scope="module")
def drafter_dir(checkpoints, tmp_path_factory):
    target = checkpoints["qwen3_5_r2"]
    return write_block_drafter(tmp_path_factory.mktemp("block"), target, seed=7, target_layer_ids=TAPS)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Qwen3's rotate-half RoPE over the whole head, x [T, heads, d]."""
    d = x.shape[-1]
    freqs = positions.double()[:, None] / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat((freqs, freqs), -1).cos()[:, None], torch.cat((freqs, freqs), -1).sin()[:, None]
    rotated = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1)
    return x * cos + rotated * sin


def dflash_logits(w: dict, cfg: dict, taps: torch.Tensor, embeds: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """z-lab's DFlash forward written out: taps [n, len(ids) * H] of positions 0..n-1, the block's embeddings
    [B, H] at positions n..n+B-1 -> the LM head's logits of every block position [B, V]."""
    n, width = taps.shape[0], embeds.shape[0]
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    ctx = rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"])
    ctx_pos, block_pos = torch.arange(n), torch.arange(n, n + width)
    x = embeds
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        both = torch.cat((ctx, h))
        q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(width, heads, d), w[p + "self_attn.q_norm.weight"])
        k = rms((both @ w[p + "self_attn.k_proj.weight"].T).view(n + width, kv, d), w[p + "self_attn.k_norm.weight"])
        v = (both @ w[p + "self_attn.v_proj.weight"].T).view(n + width, kv, d)
        q, k = rope(q, block_pos, cfg["rope_theta"]), rope(k, torch.cat((ctx_pos, block_pos)), cfg["rope_theta"])
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(width, heads * d)
        x = x + attended @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["norm.weight"]) @ lm_head.T


def block_engine(target, drafter_dir, **options):
    return LLM(str(target), dtype="float64", device="cpu", speculative="block", draft_model=str(drafter_dir), **options)


@torch.inference_mode()
def features_of(engine, tokens: list[int]) -> torch.Tensor:
    """The engine's pass over `tokens` from scratch -> its tapped layer outputs [len(tokens), taps * H]."""
    seq = new_sequence(engine, tokens)
    assert engine.cache.reserve(seq.cache, len(tokens))
    batch = build_batch([Scheduled(seq, len(tokens))], engine.cache.block_size, engine.device)
    features = engine.model.run(batch, engine.cache.caches)[1]
    engine.cache.release(seq.cache)
    return features


@pytest.mark.parametrize("pending_rows", [1024, 4])  # features projected at the proposal, or as they arrive
def test_taps_are_the_reference_hidden_states_and_drafts_are_dflash_ones(
    checkpoints, drafter_dir, pending_rows, monkeypatch
):
    monkeypatch.setattr("deltaspec.spec.block.PENDING_ROWS", pending_rows)
    target = checkpoints["qwen3_5_r2"]
    engine = block_engine(target, drafter_dir).engine
    tokens = PROMPTS[1]
    n = len(tokens) - 1  # context: positions 0..n-1; the anchor tokens[n] opens the block
    features = features_of(engine, tokens[:n])
    reference = load_reference(target, torch.float64)
    with torch.no_grad():
        states = reference(torch.tensor([tokens[:n]]), output_hidden_states=True).hidden_states
    taps = torch.cat([states[i + 1][0] for i in TAPS], -1)  # hidden_states[i + 1] is layer i's output
    torch.testing.assert_close(features, taps, rtol=0, atol=1e-9)

    cfg = json.loads((drafter_dir / "config.json").read_text())
    width = cfg["block_size"]
    block = [tokens[n]] + [cfg["dflash_config"]["mask_token_id"]] * (width - 1)
    embed = reference.get_input_embeddings().weight
    weights = {name: t.double() for name, t in load_file(drafter_dir / "model.safetensors").items()}
    logits = dflash_logits(weights, cfg, taps, embed[block], reference.get_output_embeddings().weight)
    drafter = engine.speculator.drafter
    for first in range(0, n, 3):  # rows arrive as passes commit them
        drafter.observe("seq", first, features[first : first + 3])
    held = sum(f.shape[0] for arrivals in drafter.pending.values() for _, f in arrivals)
    assert held == n if pending_rows > n else held <= pending_rows
    draft = drafter.propose([DraftRequest("seq", tokens, width - 1)])[0]
    assert draft.tokens == logits[1:].argmax(-1).tolist()  # block position i drafts position n + i


@pytest.mark.parametrize("speculative", ["block", "block+ngram"])
@pytest.mark.parametrize("k", [1, 3, 7, 15])
def test_block_greedy_is_token_identical_in_float64(checkpoints, drafter_dir, speculative, k):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = LLM(str(checkpoints["qwen3_5_r2"]), dtype="float64", device="cpu").generate(prompts, params)
    llm = LLM(
        str(checkpoints["qwen3_5_r2"]),
        dtype="float64",
        device="cpu",
        speculative=speculative,
        draft_tokens=k,
        draft_model=str(drafter_dir),
    )
    spec = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.get("spec_rounds", 0) for o in spec) > 0
    again = llm.generate(prompts, params)  # resumed from prefix checkpoints: the drafter's context starts later
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.speculator.state_bytes() == 0  # finished sequences leave nothing behind


def test_block_drafts_are_accepted_when_they_are_right(tmp_path):
    """A 6-token vocabulary makes random drafts right often: accepted drafts and rejected ones both occur, and
    greedy output stays exact through every rollback."""
    target = write_checkpoint(tmp_path / "t", "qwen3_5", seed=11, vocab_size=6)
    drafter = write_block_drafter(tmp_path / "b", target, seed=3, block_size=8, target_layer_ids=(1,), mask_token_id=5)
    prompts = [{"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2]}, {"prompt_token_ids": [4, 0, 4]}]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(str(target), dtype="float64", device="cpu").generate(prompts, params)
    spec = block_engine(target, drafter, draft_tokens=7).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    drafted = sum(sum(o.metrics["drafted_at"]) for o in spec)
    accepted = sum(o.metrics["spec_accepted_tokens"] for o in spec)
    assert 0 < accepted < drafted


def test_block_sampling_matches_plain_sampling_in_distribution(tmp_path):
    from tests.spec.test_speculative import chi_square

    target = write_checkpoint(tmp_path / "t", "qwen3_5", seed=11, vocab_size=6)
    drafter = write_block_drafter(tmp_path / "b", target, seed=3, block_size=4, target_layer_ids=(1,), mask_token_id=5)
    prompt, n = [1, 2, 3, 1, 2, 3, 1, 2], 3000
    options = dict(max_num_seqs=256, max_model_len=32)
    plain = LLM(str(target), dtype="float64", device="cpu", **options).generate(
        [{"prompt_token_ids": prompt}] * n,
        [SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)],
    )
    spec = block_engine(target, drafter, draft_tokens=3, **options).generate(
        [{"prompt_token_ids": prompt}] * n,
        [SamplingParams(max_tokens=6, temperature=1.0, seed=10_000 + s, ignore_eos=True) for s in range(n)],
    )
    assert sum(o.metrics.get("spec_accepted_tokens", 0) for o in spec) > n // 20
    for position in range(6):
        a = torch.bincount(torch.tensor([o.outputs[0].token_ids[position] for o in plain]), minlength=6)
        b = torch.bincount(torch.tensor([o.outputs[0].token_ids[position] for o in spec]), minlength=6)
        assert chi_square(a, b) < 20.5  # 5 degrees of freedom, p = 0.001


def test_dflash_config_variants_parse():
    raw = {
        "hidden_size": 64,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "intermediate_size": 96,
        "num_target_layers": 36,
        "dflash_config": {"mask_token_id": 9, "block_size": 8},
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
        "sliding_window": 2048,
    }
    config = BlockDrafterConfig.from_json(raw, "x")
    assert config.target_layer_ids == (1, 9, 17, 25, 33) == default_target_layers(36, 5)
    assert config.block_size == 8 and config.head_dim == 16 and config.num_kv_heads == 4
    assert config.causal == (True,) * 4 + (False,) and config.sliding_window == (2048,) * 4 + (None,)
    assert BlockDrafterConfig.from_json(config.to_json(36), "y") == config


@pytest.mark.parametrize(
    "scaling",
    [
        {"factor": 4.0, "original_max_position_embeddings": 32768},
        {"factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2, "truncate": False},
        {"factor": 2.0, "original_max_position_embeddings": 8192, "mscale": 0.707, "mscale_all_dim": 1.0},
    ],
)
def test_yarn_rope_is_transformers_yarn(scaling):
    """Qwen3.6 targets' drafters scale RoPE with YaRN: frequencies and cos / sin scale as transformers has them."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from deltaspec.ops.rope import YarnScaling

    params = {"rope_type": "yarn", "rope_theta": 1e7, **scaling}
    hf = Qwen3Config(head_dim=128, max_position_embeddings=131072, rope_parameters=params)
    expected, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    yarn = YarnScaling.from_config(params, 131072)
    torch.testing.assert_close(yarn.inv_frequencies(128, 1e7, torch.float32, "cpu"), expected, rtol=1e-6, atol=0)
    assert yarn.scale() == pytest.approx(attention_factor, rel=1e-12)
    raw = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 96}
    dflash = {"mask_token_id": 1, "target_layer_ids": [2]}
    config = BlockDrafterConfig.from_json({**raw, "rope_scaling": params, "dflash_config": dflash}, "x")
    assert config.yarn == yarn and BlockDrafterConfig.from_json(config.to_json(8), "y") == config


def test_block_drafter_errors_are_clear(checkpoints, drafter_dir, tmp_path):
    target = checkpoints["qwen3_5_r2"]
    with pytest.raises(DeltaspecError, match="needs --draft-model PATH to a block drafter"):
        LLM(str(target), device="cpu", speculative="block")
    with pytest.raises(DeltaspecError, match="is not a block drafter"):
        block_engine(target, checkpoints["qwen3_next_r3_moe"])
    cases = [
        ({"hidden_size": 32}, "hidden size 32"),
        ({"dflash_config": {"mask_token_id": 10**6, "target_layer_ids": [0]}}, "outside the target's vocabulary"),
        ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 9]}}, r"reads target layers \[9\]"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "'longrope' RoPE scaling"),
    ]
    config = json.loads((drafter_dir / "config.json").read_text())
    for i, (change, message) in enumerate(cases):
        broken = tmp_path / f"broken{i}"
        broken.mkdir()
        (broken / "config.json").write_text(json.dumps({**config, **change}))
        (broken / "model.safetensors").write_bytes((drafter_dir / "model.safetensors").read_bytes())
        with pytest.raises(DeltaspecError, match=message):
            block_engine(target, broken)
    missing = write_block_drafter(tmp_path / "missing", target, seed=1, target_layer_ids=TAPS)
    weights = load_file(missing / "model.safetensors")
    del weights["layers.1.mlp.down_proj.weight"]
    from safetensors.torch import save_file

    save_file(weights, missing / "model.safetensors")
    with pytest.raises(DeltaspecError, match="lacks 1 tensors"):
        block_engine(target, missing)


def test_sliding_window_layers_keep_only_their_window_and_draft_the_same(checkpoints, tmp_path):
    """A sliding-window layer's queries never see keys older than its window, so dropping them changes no draft
    (float64) while the context held stays bounded."""
    target = checkpoints["qwen3_5_r2"]
    window = 4
    drafter_dir = write_block_drafter(
        tmp_path / "swa",
        target,
        seed=9,
        target_layer_ids=TAPS,
        block_size=8,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=window,
    )
    engine = block_engine(target, drafter_dir).engine
    trimming = engine.speculator.drafter
    whole = type(trimming)(trimming.net, engine.model, engine.device, 0)
    whole.windows = (None, None)  # keeps every row; the masks still apply the window
    tokens = PROMPTS[0] + PROMPTS[1] + PROMPTS[2]  # 58 tokens
    n = len(tokens) - 1
    features = features_of(engine, tokens[:n])
    for first in range(0, n, 3):  # rows arrive a few at a time, as passes commit them
        end = min(first + 3, n)
        for drafter in (trimming, whole):
            drafter.observe("seq", first, features[first:end])
        if first >= 6:
            request = [DraftRequest("seq", tokens[: end + 1], 7)]
            assert trimming.propose(request)[0].tokens == whole.propose(request)[0].tokens
    held = trimming.contexts["seq"].layers
    assert held[0].rows <= 2 * window and held[0].keys.shape[0] == 2 * window  # the sliding layer stays bounded
    assert (held[1].first, held[1].rows) == (0, n)
    assert trimming.state_bytes() < whole.state_bytes()


def test_the_plan_counts_the_drafter_weights_its_full_context_and_its_windows(checkpoints, tmp_path):
    from deltaspec.config.engine import EngineConfig
    from deltaspec.config.resolve import resolve_engine_config
    from deltaspec.model.hf_config import parse_model_config, read_config_json
    from deltaspec.spec.factory import drafter_memory

    target = checkpoints["qwen3_5_r2"]
    path = write_block_drafter(
        tmp_path / "b",
        target,
        seed=1,
        target_layer_ids=TAPS,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
    )
    config = EngineConfig.from_flat(
        model=str(target), speculative="block", draft_model=str(path), dtype="float32", state_dtype="float32"
    )
    config = resolve_engine_config(config, checkpoint_dtype="float32")
    memory = drafter_memory(config, target, parse_model_config(read_config_json(target)), 0)
    weights = sum(t.numel() * 4 for t in load_file(path / "model.safetensors").values())
    row = 2 * 2 * 16 * 4  # keys and values, 2 KV heads of 16 values, float32
    assert (memory.weights, memory.kv_per_token, memory.state_per_stream) == (weights, row, 2 * 16 * row)
    assert memory.features_per_row == len(TAPS) * 64 * 4  # the taps of a 64-wide target, float32


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 5)])
def test_training_forward_of_many_anchored_blocks_is_the_drafting_forward(causal, window):
    """`forward_anchored` (training: every block of every sequence in one attention call per layer, each seeing the
    context before its anchor) gives what `forward` gives each block with its context cut at its anchor (float64)."""
    from deltaspec.model.block_drafter import BlockDrafterModel
    from deltaspec.ops.dispatch import ops_for

    width, layers, context_len = 4, 2, 24
    config = BlockDrafterConfig(
        hidden_size=32,
        intermediate_size=48,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        block_size=width,
        target_layer_ids=(0, 1),
        mask_token_id=0,
        target_hidden_size=16,
        causal=(causal, False),
        sliding_window=(window, None),
    )
    torch.manual_seed(0)
    net = BlockDrafterModel(config, ops_for("cpu", reference_only=True), torch.float64, "cpu").double()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0.0, 0.3)
    features = torch.randn(2, context_len, 32, dtype=torch.float64)
    anchors = torch.tensor([[1, 7, 19], [3, 4, 16]])
    embeds = torch.randn(2, 3 * width, 32, dtype=torch.float64)
    positions = torch.arange(context_len).repeat(2)
    context = [
        (k.view(2, context_len, 2, 8), v.view(2, context_len, 2, 8))
        for k, v in net.context_keys_values(features.flatten(0, 1), positions)
    ]
    got = net.forward_anchored(embeds, context, anchors)
    for r in range(2):
        for s, a in enumerate(anchors[r].tolist()):
            cut = [[(k[r, :a], v[r, :a])] for k, v in context]
            want = net(
                embeds[r, s * width : (s + 1) * width], torch.arange(a, a + width), cut, [[torch.arange(a)]] * layers
            )
            torch.testing.assert_close(got[r, s * width : (s + 1) * width], want, rtol=1e-12, atol=1e-12)
