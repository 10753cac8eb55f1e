"""deltaspec.ops.quant.presets: llama-quantize's per-tensor type choices.

tests/data/quant/presets.json.gz records what `llama-quantize --dry-run` chose for every tensor of four made-up
Qwen3.5-family files (tools/make_quant_oracles.py); the rest checks a Qwen3.5-27B tensor list against the rules.
"""

import gzip
import json
from pathlib import Path

import pytest

from deltaspec.errors import DeltaspecError
from deltaspec.ops.quant.presets import allows_quantization, preset_type, preset_types

with gzip.open(Path(__file__).parents[1] / "data" / "quant" / "presets.json.gz", "rt") as _file:
    RECORDED = json.load(_file)
HIDDEN, FF, VOCAB = 5120, 17408, 248320
# use_more_bits(i, 64), written out: the first and last 8 layers and every third one from 10
MORE_BITS_64 = {*range(8), *range(10, 56, 3), *range(56, 64)}


def qwen35_27b(n_layers: int = 64, tied: bool = False) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, torch shape, type) of a Qwen3.5-27B GGUF: GDN layers, and full attention every fourth layer."""
    tensors = [("token_embd.weight", (VOCAB, HIDDEN), "BF16"), ("output_norm.weight", (HIDDEN,), "F32")]
    if not tied:
        tensors.append(("output.weight", (VOCAB, HIDDEN), "BF16"))
    for i in range(n_layers):
        shapes = {"attn_norm.weight": (HIDDEN,), "post_attention_norm.weight": (HIDDEN,)}
        if i % 4 == 3:
            shapes |= {
                "attn_q.weight": (12288, HIDDEN),
                "attn_k.weight": (1024, HIDDEN),
                "attn_v.weight": (1024, HIDDEN),
                "attn_output.weight": (HIDDEN, 6144),
                "attn_q_norm.weight": (256,),
                "attn_k_norm.weight": (256,),
            }
        else:
            shapes |= {
                "attn_qkv.weight": (10240, HIDDEN),
                "attn_gate.weight": (6144, HIDDEN),
                "ssm_conv1d.weight": (10240, 4),
                "ssm_dt.bias": (48,),
                "ssm_a": (48,),
                "ssm_beta.weight": (48, HIDDEN),
                "ssm_alpha.weight": (48, HIDDEN),
                "ssm_norm.weight": (128,),
                "ssm_out.weight": (HIDDEN, 6144),
            }
        shapes |= {"ffn_gate.weight": (FF, HIDDEN), "ffn_up.weight": (FF, HIDDEN), "ffn_down.weight": (HIDDEN, FF)}
        tensors += [(f"blk.{i}.{name}", shape, "F32" if len(shape) == 1 else "BF16") for name, shape in shapes.items()]
    return tensors


def expected_27b(preset: str) -> dict[str, str]:
    """llama-quant.cpp's choices for qwen35_27b(), derived by hand from llama_tensor_get_type_impl."""
    default = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "Q8_0": "Q8_0"}[preset]
    bumped = preset in ("Q4_K_M", "Q5_K_M")
    chosen = {}
    for name, shape, source in qwen35_27b():
        if len(shape) == 1 or "ssm_conv1d" in name:
            chosen[name] = source
        elif name == "output.weight":
            chosen[name] = "Q8_0" if preset == "Q8_0" else "Q6_K"
        elif name.endswith(("attn_qkv.weight", "attn_v.weight", "ffn_down.weight")):
            chosen[name] = "Q6_K" if bumped and int(name.split(".")[1]) in MORE_BITS_64 else default
        else:
            chosen[name] = default
    return chosen


@pytest.mark.parametrize("model", sorted(RECORDED))
@pytest.mark.parametrize("preset", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"])
def test_matches_llama_quantize(model, preset):
    recorded = RECORDED[model]
    tensors = [(name, tuple(shape), source) for name, shape, source in recorded["tensors"]]
    chosen = preset_types(preset, tensors, n_layers=recorded["n_layers"], n_expert=recorded["n_expert"])
    expected = dict(zip((name for name, _, _ in tensors), recorded["choices"][preset]))
    wrong = {name: (chosen[name], expected[name]) for name in expected if chosen[name] != expected[name]}
    assert not wrong, f"(ours, llama-quantize): {wrong}"


@pytest.mark.parametrize("preset", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"])
def test_qwen35_27b(preset):
    assert preset_types(preset, qwen35_27b(), n_layers=64) == expected_27b(preset)


def test_q4_k_m_mix_counts():
    chosen = preset_types("Q4_K_M", qwen35_27b(), n_layers=64)
    counts = {}
    for qtype in chosen.values():
        counts[qtype] = counts.get(qtype, 0) + 1
    # output + 32 of the 64 attn_qkv/attn_v + 32 of the 64 ffn_down
    assert counts["Q6_K"] == 65
    assert chosen["blk.3.attn_v.weight"] == "Q6_K" and chosen["blk.11.attn_v.weight"] == "Q4_K"
    assert chosen["blk.10.attn_qkv.weight"] == "Q6_K" and chosen["blk.9.attn_qkv.weight"] == "Q4_K"
    assert chosen["blk.0.ssm_beta.weight"] == "Q4_K" and chosen["token_embd.weight"] == "Q4_K"


def test_tied_embeddings_get_the_output_type():
    chosen = preset_types("Q5_K_M", qwen35_27b(tied=True), n_layers=64)
    assert chosen["token_embd.weight"] == "Q6_K"


def test_mtp_layer_counts_in_the_layers():
    # block_count 65: use_more_bits(i, 65) has 65/8 = 8 and 7*65/8 = 56, so the MTP layer (64) gets Q6_K
    tensors = qwen35_27b(n_layers=65)
    chosen = preset_types("Q4_K_M", tensors, n_layers=65)
    assert chosen["blk.64.ffn_down.weight"] == "Q6_K" and chosen["blk.55.ffn_down.weight"] == "Q6_K"
    assert chosen["blk.54.ffn_down.weight"] == "Q4_K"


def test_single_tensor_defaults_follow_the_layer():
    assert preset_type("Q4_K_M", "blk.13.ffn_down.weight", (HIDDEN, FF), n_layers=64) == "Q6_K"
    assert preset_type("Q4_K_M", "blk.14.ffn_down.weight", (HIDDEN, FF), n_layers=64) == "Q4_K"
    assert preset_type("Q4_K_M", "blk.14.ssm_conv1d.weight", (10240, 4), n_layers=64, source_type="BF16") == "BF16"


def test_moe_experts_take_the_layer_from_the_name():
    shape = (512, 2048, 512)  # [experts, rows, cols]
    assert preset_type("Q4_K_M", "blk.1.ffn_down_exps.weight", shape, n_layers=48, n_expert=512) == "Q6_K"
    assert preset_type("Q4_K_M", "blk.9.ffn_down_exps.weight", shape, n_layers=48, n_expert=512) == "Q4_K"
    assert preset_type("Q4_K_M", "blk.8.ffn_up_shexp.weight", (512, 2048), n_layers=48, n_expert=512) == "Q4_K"
    assert not allows_quantization("blk.8.ffn_gate_inp.weight", (512, 2048))  # the router stays as it is
    assert not allows_quantization("blk.8.ffn_gate_inp_shexp.weight", (2048,))
    with pytest.raises(DeltaspecError, match="names layer 48"):
        preset_type("Q4_K_M", "blk.48.ffn_down_exps.weight", shape, n_layers=48, n_expert=512)


def test_eight_experts_bump_attention():
    assert preset_type("Q4_K_M", "blk.0.attn_v.weight", (256, 256), n_layers=4, n_expert=8) == "Q8_0"
    assert preset_type("Q4_K_M", "blk.0.attn_k.weight", (256, 256), n_layers=4, n_expert=8) == "Q8_0"
    assert preset_type("Q4_K_M", "blk.0.attn_output.weight", (256, 256), n_layers=4, n_expert=8) == "Q5_K"


@pytest.mark.parametrize(
    ("preset", "name", "cols", "expected"),
    [
        ("Q4_K_M", "blk.20.ffn_up.weight", 64, "Q5_0"),  # Q4_K -> Q5_0
        ("Q5_K_M", "blk.20.ffn_up.weight", 64, "Q5_1"),  # Q5_K -> Q5_1
        ("Q4_K_M", "blk.0.ffn_down.weight", 64, "Q8_0"),  # Q6_K -> Q8_0
        ("Q6_K", "blk.20.ffn_up.weight", 48, "F16"),  # Q8_0 does not fit either
        ("Q4_K_M", "output.weight", 64, "Q8_0"),  # not a whole number of Q4_K blocks
        ("Q8_0", "output.weight", 40, "F16"),
    ],
)
def test_fallback_for_narrow_rows(preset, name, cols, expected):
    assert preset_type(preset, name, (128, cols), n_layers=64) == expected


def test_unknown_preset_is_one_sentence():
    with pytest.raises(DeltaspecError, match="Unknown quantization preset 'Q4_K_XL'"):
        preset_type("Q4_K_XL", "output.weight", (128, 256), n_layers=1)
