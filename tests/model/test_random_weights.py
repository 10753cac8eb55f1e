"""`--random-weights --shape NAME`: real shapes as ModelConfigs, parameter counts without allocation, seeded random
models that run through the engine, the memory plan, and the CLI's errors and boolean flags."""

import pytest
import torch

from deltaspec import LLM
from deltaspec.cli import build_parser, engine_config, main
from deltaspec.config.engine import EngineConfig
from deltaspec.config.model import FULL_ATTENTION
from deltaspec.engine.engine import Engine
from deltaspec.engine.planning import plan_for
from deltaspec.errors import DeltaspecError
from deltaspec.model.hybrid import HybridModel
from deltaspec.model.random_init import random_model
from deltaspec.model.shapes import SHAPES, parameter_counts, shape_config
from deltaspec.ops.dispatch import ops_for
from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.sample.params import SamplingParams

# A 27B-shaped model cut down for a 2-core CI machine: the real heads and head dims, fewer layers, narrower.
SMALL = (("num_hidden_layers", 4), ("hidden_size", 64), ("intermediate_size", 128), ("vocab_size", 512))


def test_qwen35_27b_has_the_issue_numbers_and_27b_parameters():
    c = shape_config("qwen3.5-27b")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (64, 5120, 17408, 248320)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (24, 4, 256)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim) == (
        16,
        48,
        128,
        128,
    )
    assert c.attention_layer_ids == tuple(range(3, 64, 4)) and c.layer_types[3] == FULL_ATTENTION
    assert (c.partial_rotary_factor, c.rope_theta, c.tie_word_embeddings, c.num_mtp_layers) == (0.25, 1e7, False, 1)
    counts = parameter_counts(c)
    assert 26.5e9 < counts["total"] - counts["mtp"] < 27.5e9
    assert counts["embedding"] == counts["lm_head"] == 248320 * 5120


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_parameter_count_matches_the_model_built_on_meta(name):
    config = shape_config(name)
    with torch.device("meta"):
        model = HybridModel(config, ops_for(torch.device("cpu")), torch.float32, "meta", config.num_mtp_layers)
    tied = config.tie_word_embeddings  # the LM head becomes the embedding table when the weights are loaded
    params = [p for n, p in model.named_parameters() if not (tied and n == "lm_head.weight")]
    assert sum(p.numel() for p in params) == parameter_counts(config)["total"]
    moe = parameter_counts(config)["experts"]
    assert (moe > 0) == (config.moe is not None)


def test_overrides_rederive_layers_and_reach_moe_fields():
    c = shape_config("qwen3-next-80b-a3b", (("num_hidden_layers", 8), ("num_experts", 4)))
    assert c.num_hidden_layers == 8 and len(c.layer_types) == len(c.moe_layers) == 8 and c.moe.num_experts == 4
    assert c.gdn_layout == "qwen3_next" and c.attention_layer_ids == (3, 7)
    with pytest.raises(DeltaspecError, match="dense"):
        shape_config("qwen3.5-27b", (("num_experts", 4),))
    with pytest.raises(DeltaspecError, match="Unknown shape 'qwen9'"):
        shape_config("qwen9")


def test_random_model_is_seeded_finite_and_input_dependent():
    config = shape_config("qwen3.5-27b", SMALL)
    ops = ops_for(torch.device("cpu"))
    a = random_model(config, torch.float32, torch.device("cpu"), ops, seed=1, progress=False)
    b = random_model(config, torch.float32, torch.device("cpu"), ops, seed=1, progress=False)
    c = random_model(config, torch.float32, torch.device("cpu"), ops, seed=2, progress=False)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not torch.equal(pa["lm_head.weight"], pc["lm_head.weight"])
    assert all(torch.isfinite(p).all() for p in pa.values())
    assert torch.all(pa["model.norm.weight"] == 0)  # zero-centred norms start at the identity
    a_log = pa["model.layers.0.linear_attn.A_log"]
    assert torch.all(a_log.exp() <= 16) and torch.all(pa["model.layers.0.linear_attn.dt_bias"] == 1)


@pytest.mark.parametrize("source", ["random", "checkpoint"])
def test_fusing_frees_each_projections_parts_as_it_goes(monkeypatch, checkpoints, source):
    """Peak memory of a loaded model is its weights plus one fused projection: once a group is fused, nothing keeps
    its parts (a 27B model's parts outliving their fused copies took 24 GB more than an 80 GB card has)."""
    import weakref

    import deltaspec.model.attention
    import deltaspec.model.gdn
    import deltaspec.model.layers

    fuse = deltaspec.model.layers.fuse
    previous: list[weakref.ref] = []
    freed: list[bool] = []

    def fuse_and_check(module, fused_name, part_names, ops):
        freed.append(all(part() is None for part in previous))  # the group fused before this one left nothing
        previous[:] = [weakref.ref(getattr(module, name).weight) for name in part_names]
        fuse(module, fused_name, part_names, ops)

    for module in (deltaspec.model.layers, deltaspec.model.attention, deltaspec.model.gdn):
        monkeypatch.setattr(module, "fuse", fuse_and_check)
    if source == "random":
        config = shape_config("qwen3.5-27b", SMALL)
        random_model(config, torch.float32, torch.device("cpu"), ops_for("cpu"), progress=False)
    else:
        LLM(str(checkpoints["qwen3_5_r2"]), device="cpu")
    assert len(freed) > 4 and all(freed)


def test_deep_bfloat16_stack_stays_finite_with_varied_logits():
    """12 layers in bf16 at the real head geometry: no inf/nan, logits that depend on the token."""
    deep = (("num_hidden_layers", 12), ("hidden_size", 128), ("intermediate_size", 256), ("vocab_size", 256))
    engine = Engine(
        EngineConfig.from_flat(
            random_weights=True,
            shape="qwen3.5-27b",
            shape_overrides=deep,
            device="cpu",
            dtype="bfloat16",
            max_model_len=64,
            max_num_seqs=1,
        ),
        progress=False,
    )
    assert engine.model_config.num_hidden_layers == 12 and engine.model_config.linear_num_value_heads == 48
    hidden = engine.model.model.embed_tokens(torch.arange(8))
    logits = engine.model.compute_logits(engine.model.model.norm(hidden)).float()
    seq = engine.add_request(
        "r", None, list(range(20, 28)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    while engine.has_unfinished():
        engine.step()
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    assert len(seq.output_ids) == 4 and len(set(seq.output_ids)) > 1


def test_engine_runs_the_moe_shapes_with_random_weights():
    for name, extra in (
        (
            "qwen3.5-35b-a3b",
            (
                ("num_experts", 4),
                ("num_experts_per_tok", 2),
                ("moe_intermediate_size", 16),
                ("shared_expert_intermediate_size", 16),
            ),
        ),
        (
            "qwen3-next-80b-a3b",
            (
                ("num_experts", 4),
                ("num_experts_per_tok", 2),
                ("moe_intermediate_size", 16),
                ("shared_expert_intermediate_size", 16),
            ),
        ),
    ):
        engine = Engine(
            EngineConfig.from_flat(
                random_weights=True,
                shape=name,
                shape_overrides=SMALL + extra,
                device="cpu",
                max_model_len=32,
                max_num_seqs=1,
                num_kv_blocks=0,
            ),
            progress=False,
        )
        assert engine.tokenizer is None and engine.model_dir is None
        seq = engine.add_request("r", None, [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        assert len(seq.output_ids) == 3 and all(0 <= t < 512 for t in seq.output_ids)


def test_memory_plan_counts_the_shape_weights_without_allocating():
    planned = plan_for(EngineConfig.from_flat(random_weights=True, shape="qwen3.5-27b", dtype="bfloat16", device="cpu"))
    plan, counts = planned.plan, parameter_counts(planned.model_config)
    assert plan.weights == (counts["total"] - counts["mtp"]) * 2 and 48 < plan.weights / 2**30 < 52
    assert planned.model_dir is None and planned.raw == {} and planned.config.load.dtype == "bfloat16"
    assert plan.kv_per_token == 16 * 2 * 4 * 256 * 2 and plan.drafter_bytes == 0  # 16 attention layers, no MTP
    mtp = plan_for(
        EngineConfig.from_flat(
            random_weights=True, shape="qwen3.5-27b", dtype="bfloat16", device="cpu", speculative="mtp"
        )
    ).plan
    assert mtp.weights == plan.weights and mtp.drafter.weights == counts["mtp"] * 2  # the MTP head, as a drafter
    assert mtp.drafter.kv_per_token == 1 * 2 * 4 * 256 * 2 and mtp.total > plan.total


def test_cli_bool_flags_and_python_only_fields():
    parser = build_parser()
    args = parser.parse_args(["plan", "--random-weights", "--shape", "qwen3.5-9b"])
    assert engine_config(args).load.random_weights is True and engine_config(args).load.shape == "qwen3.5-9b"
    assert engine_config(parser.parse_args(["plan"])).load.random_weights is False
    assert engine_config(parser.parse_args(["plan", "--no-random-weights"])).load.random_weights is False
    with pytest.raises(SystemExit):
        parser.parse_args(["plan", "--shape-overrides", "x"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--random-weights"], "needs --shape"),
        (["--shape", "qwen3.5-27b"], "only applies with --random-weights"),
        (["--random-weights", "--shape", "gpt-5"], "Unknown shape"),
        (["--random-weights", "--shape", "qwen3.5-27b", "--model", "x"], "drop --model"),
    ],
)
def test_user_errors_are_one_sentence(argv, message, capsys):
    assert main(["plan", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_plan_command_prints_the_random_weights_budget(capsys):
    code = main(["plan", "--random-weights", "--shape", "qwen3.5-27b", "--dtype", "bfloat16", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code in (0, 2) and out.startswith("weights") and "50.098" in out.splitlines()[0]  # without the MTP head


def test_a_real_shaped_random_model_borrows_the_embedded_tokenizer():
    """Text prompts work on random weights when the embedded tokenizer's ids fit the shape's vocabulary."""
    engine = Engine(
        EngineConfig.from_flat(
            random_weights=True,
            shape="qwen3.5-0.8b",
            shape_overrides=SMALL + (("vocab_size", 3 * 8192),),
            device="cpu",
            max_model_len=64,
            max_num_seqs=1,
        ),
        progress=False,
    )
    assert engine.tokenizer is not None and engine.tokenizer.vocab_size <= 8192
    ids = engine.encode("def add(a, b):")
    seq = engine.add_request("r", "def add(a, b):", ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(seq.output_ids) == 2
    tokenizer = engine.tokenizer
    word = tokenizer.encode(" add")[0]
    assert tokenizer.decode([word + 2 * 8192]) == tokenizer.decode([word]) == " add"
    assert tokenizer.decode_token(word + 8192) == " add" and tokenizer.id_to_token(word + 8192) is not None


QUANT_SMALL = (("num_hidden_layers", 8), ("hidden_size", 256), ("intermediate_size", 512), ("vocab_size", 512))


@pytest.mark.parametrize("shape", ["qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b"])
def test_random_weights_quantized_like_a_q4_k_m_file(shape):
    """--quant q4_k_m keeps each matrix as the blocks llama-quantize would give it (Q6_K for the LM head and half
    the layers' ffn_down / attn_v-like tensors, Q4_K elsewhere; Qwen3-Next's GDN projections separate, as its
    GGUF file loads, so q|k|v and z each take their file tensor's type); the plan counts those bytes; decoding
    runs."""
    moe = (("moe_intermediate_size", 256), ("shared_expert_intermediate_size", 256), ("num_experts", 16))
    heads = (("linear_num_key_heads", 2), ("linear_num_value_heads", 4))
    extra = (moe if "a3b" in shape else ()) + (heads if "next" in shape else ())
    options = dict(random_weights=True, shape=shape, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=64)
    llm = LLM(shape_overrides=QUANT_SMALL + extra, quant="q4_k_m", **options)
    kept = [m for m in llm.engine.model.modules() if isinstance(m, QuantizedWeight)]
    assert {"Q4_K", "Q6_K"} <= {q for w in kept for q in w.qtypes}
    assert "Q6_K" in llm.engine.model.lm_head.weight.qtypes
    if "next" in shape:  # layer 0's attn_qkv gets more bits than its attn_gate, as in llama-quantize's file
        assert llm.engine.model.model.layers[0].linear_attn.in_proj.weight.qtypes == ("Q6_K", "Q4_K")
    blocks = {id(b): b.numel() for w in kept for b in w.buffers()}
    floats = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    assert llm.engine.plan.weights == sum(blocks.values()) + floats
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(DeltaspecError, match="Unknown --quant 'q4_k_xx'"):
        LLM(shape_overrides=QUANT_SMALL + extra, quant="q4_k_xx", **options)


@pytest.mark.parametrize(("quant", "qtype"), [("fp8", "FP8_B128"), ("int4", "I4_G128"), ("i4_g32", "I4_G32")])
def test_random_weights_in_a_hugging_face_checkpoints_layout(quant, qtype):
    """--quant fp8 / int4 / i4_g32: every matrix in the checkpoint format's blocks but the embeddings, the LM head
    and the routers, which such checkpoints keep in bf16; the plan counts what the engine holds."""
    options = dict(random_weights=True, shape="qwen3.5-35b-a3b", dtype="float32", device="cpu", max_num_seqs=1)
    llm = LLM(shape_overrides=QUANT_SMALL + (("num_experts", 8),), quant=quant, max_model_len=64, **options)
    model = llm.engine.model
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedWeight)}
    kept = list(quantized.values())
    assert {q for w in kept for q in w.qtypes} == {qtype}
    assert "lm_head.weight" not in quantized and not any("router" in name for name in quantized)
    floats = sum(p.numel() * p.element_size() for p in model.parameters())
    assert llm.engine.plan.weights == sum(w.nbytes for w in kept) + floats
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_quant_needs_random_weights():
    with pytest.raises(DeltaspecError, match="--quant quantizes --random-weights"):
        LLM(quant="q8_0", device="cpu")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "IQ4_XS", "Q2_K", "Q5_1", "FP8_B128", "I4_G128", "I4_G32"])
def test_random_blocks_are_distributed_like_quantized_normal_weights(qtype):
    """Blocks drawn from the pool with scaled float16 (FP8: float32, I4: bfloat16) scales dequantize to values with
    the std of the exact quantization of N(0, std²) (within 2 %; measured 0.3 %) and a mean within 3 % of the std
    (measured 1.2 % at most, the pool's own sample mean); every row differs, and the seed fixes the bytes."""
    from deltaspec.model.random_quant import random_blocks
    from deltaspec.ops.quant.dequant import dequantize
    from deltaspec.ops.quant.quantize import quantize

    std = 0.03
    weight = random_blocks(torch.Size((256, 1024)), qtype, std, torch.Generator().manual_seed(0), {})
    (_, blocks), *_ = weight.segments
    values = dequantize(blocks, qtype).double()
    drawn = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1)) * std
    exact = dequantize(quantize(drawn, qtype), qtype).double()
    assert values.shape == (256, 1024)
    assert values.std().item() == pytest.approx(exact.std().item(), rel=0.02)
    assert abs(values.mean().item()) < 0.03 * std
    assert len({bytes(row.tolist()) for row in blocks}) == 256
    again = random_blocks(torch.Size((256, 1024)), qtype, std, torch.Generator().manual_seed(0), {})
    assert torch.equal(again.segments[0][1], blocks)
