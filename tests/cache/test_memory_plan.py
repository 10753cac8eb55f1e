"""The memory planner counts what the engine really allocates, and refuses what does not fit."""

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from deltaspec import LLM, DeltaspecError, SamplingParams
from deltaspec.cli import main
from deltaspec.config.engine import EngineConfig
from deltaspec.engine.planning import plan_for
from tests.tiny_models import write_checkpoint


@pytest.mark.parametrize("name", ["qwen3_5_r1_tied", "qwen3_next_r3_moe"])
def test_plan_matches_the_allocations(checkpoints, name):
    llm = LLM(str(checkpoints[name]), dtype="float64", device="cpu", max_num_seqs=3, max_model_len=100, block_size=8)
    engine = llm.engine
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in engine.model.parameters()}
    assert engine.plan.weights == sum(unique.values())
    assert engine.plan.kv == engine.cache.kv.bytes()
    assert engine.plan.states == engine.cache.gdn.bytes()
    assert engine.plan.fits


def test_plan_counts_the_speculative_replay_log(checkpoints):
    llm = LLM(
        str(checkpoints["qwen3_next_r3_moe"]),
        dtype="float32",
        device="cpu",
        max_num_seqs=3,
        max_model_len=64,
        speculative="ngram",
        draft_tokens=5,
    )
    assert llm.engine.plan.states == llm.engine.cache.gdn.bytes()
    plain = plan_for(
        EngineConfig.from_flat(
            model=str(checkpoints["qwen3_next_r3_moe"]), dtype="float32", device="cpu", max_num_seqs=3, max_model_len=64
        )
    ).plan
    assert llm.engine.plan.states > plain.states and llm.engine.plan.kv == plain.kv


def test_plan_with_mtp_counts_its_kv_layer_as_the_drafters():
    config = EngineConfig.from_flat(dtype="bfloat16", device="cpu", max_num_seqs=2, max_model_len=64, speculative="mtp")
    plan = plan_for(config).plan
    llm = LLM(**{f: config.flat()[f] for f in ("dtype", "device", "max_num_seqs", "max_model_len", "speculative")})
    assert llm.engine.model.mtp is not None and plan.drafter.name == "mtp"
    mtp_kv = plan.drafter_bytes - plan.drafter.weights
    assert plan.kv + mtp_kv == llm.engine.cache.kv.bytes() and plan.states == llm.engine.cache.gdn.bytes()
    assert "drafter: mtp" in plan.table()


def test_plan_counts_the_draft_models_weights_kv_and_states():
    """A draft model's weights, KV pages, state slots and snapshots are in the plan, and allocated as planned."""
    llm = LLM(dtype="float32", device="cpu", max_num_seqs=2, max_model_len=64, speculative="draft")
    plan, drafter = llm.engine.plan, llm.engine.speculator.drafter
    assert plan.drafter.name == "draft"
    assert plan.drafter.weights == sum({p.data_ptr(): p.numel() * 4 for p in drafter.model.parameters()}.values())
    assert plan.streams * plan.padded_ctx * plan.drafter.kv_per_token == drafter.cache.kv.bytes()
    slot = drafter.cache.gdn.bytes() // (plan.streams + 1)  # its slots and a scratch slot
    assert plan.drafter.state_per_stream == 2 * slot  # a slot and its snapshot per stream


def test_the_draft_models_share_is_counted_per_stream_in_the_advice(monkeypatch):
    """One stream's share of the draft model short: refused, and the advice is one stream fewer."""
    config = EngineConfig.from_flat(
        dtype="float32", device="cpu", max_num_seqs=2, max_model_len=64, speculative="draft"
    )
    plan = plan_for(config).plan
    share = plan.padded_ctx * plan.drafter.kv_per_token + plan.drafter.state_per_stream + 4 * plan.state_per_stream
    monkeypatch.setattr("deltaspec.engine.planning.available_memory", lambda device: plan.total - share // 2)
    tight = plan_for(config).plan
    assert not tight.fits and "drafter" in tight.refusal()
    assert tight.alternatives[0] == "1 stream at 64 tokens"


def _fixed_memory(monkeypatch, free: int) -> None:
    monkeypatch.setattr("deltaspec.engine.planning.available_memory", lambda device: free)
    monkeypatch.setattr("deltaspec.engine.planning.total_memory", lambda device: 2 * free)


def _advised(message: str) -> list[tuple[int, int]]:
    return [(int(s), int(c)) for s, c in re.findall(r"(\d+) streams? at (\d+) tokens", message)]


def test_a_configuration_that_does_not_fit_is_refused_with_what_would(checkpoints, monkeypatch):
    """The advice is the most streams at this context and the longest context (within the model's positions) for
    these streams; each fits as flags, and one more stream or page does not."""
    _fixed_memory(monkeypatch, 2 << 30)
    config = EngineConfig.from_flat(
        model=str(checkpoints["qwen3_5_r2"]), dtype="float32", device="cpu", max_num_seqs=100_000, max_model_len=512
    )
    plan = plan_for(config).plan
    assert not plan.fits
    with pytest.raises(DeltaspecError) as err:
        LLM(str(checkpoints["qwen3_5_r2"]), dtype="float32", device="cpu", max_num_seqs=100_000, max_model_len=512)
    message = str(err.value)
    assert "\n" not in message and message.endswith("would fit.")
    (streams, ctx), *rest = _advised(message.split(";")[-1])
    assert ctx == 512 and not rest  # 100000 streams: not even one page each fits
    assert plan_for(config.with_settings(max_num_seqs=streams)).plan.fits
    assert not plan_for(config.with_settings(max_num_seqs=streams + 1)).plan.fits
    more = plan_for(config.with_settings(max_num_seqs=streams + 100)).plan
    assert not more.fits
    (_, same), (fewer_streams, longest) = _advised(more.refusal().split(";")[-1])
    assert same == 512 and fewer_streams == streams + 100 and longest < 512
    assert plan_for(config.with_settings(max_num_seqs=streams + 100, max_model_len=longest)).plan.fits
    assert not plan_for(config.with_settings(max_num_seqs=streams + 100, max_model_len=longest + 16)).plan.fits


def test_advice_counts_the_prefix_checkpoints_of_each_stream(checkpoints, monkeypatch):
    """The most streams `plan` proposes fit when asked for: their three prefix checkpoints each are counted per
    stream, not as a fixed cost of the default eight streams."""
    _fixed_memory(monkeypatch, 1 << 30)
    config = EngineConfig.from_flat(
        model=str(checkpoints["qwen3_5_r2"]), dtype="float32", device="cpu", max_model_len=256
    )
    plan = plan_for(config).plan
    assert plan.fits and plan.streams == 8 and plan.checkpoints == 24
    most, _ = _advised(plan.table().splitlines()[-1])[0]
    assert most > 8 and plan_for(config.with_settings(max_num_seqs=most)).plan.fits
    too_many = plan_for(config.with_settings(max_num_seqs=most + 1)).plan
    assert not too_many.fits and too_many.checkpoints == 3 * (most + 1)
    assert _advised(too_many.refusal().split(";")[-1])[0] == (most, 256)


def test_advice_when_not_even_the_weights_fit(checkpoints, monkeypatch):
    weights = plan_for(
        EngineConfig.from_flat(model=str(checkpoints["qwen3_5_r2"]), dtype="float32", device="cpu")
    ).plan.weights
    _fixed_memory(monkeypatch, weights // 2)
    plan = plan_for(EngineConfig.from_flat(model=str(checkpoints["qwen3_5_r2"]), dtype="float32", device="cpu")).plan
    assert not plan.fits and not plan.alternatives
    assert "not even the weights, workspace and runtime reserve" in plan.refusal()
    assert "would fit" not in plan.refusal() and plan.refusal().endswith("more memory.")
    assert "does NOT fit; not even the weights" in plan.table()


def test_the_context_defaults_to_the_models_positions(tmp_path, monkeypatch):
    """0 (the default) is the model's max_position_embeddings, shortened to what the streams fit in memory; a longer
    --max-model-len is refused unless explicitly allowed, and the advice never goes past the positions."""
    model = str(write_checkpoint(tmp_path / "m", "qwen3_5", max_position_embeddings=2048))
    config = EngineConfig.from_flat(model=model, dtype="float32", device="cpu")
    planned = plan_for(config)
    assert (
        planned.config.scheduler.max_model_len == 2048
        and planned.plan.ctx == 2048
        and planned.config.scheduler.max_num_seqs == 8
    )
    assert "8 streams at 2048 tokens (the model's positions)" in planned.plan.table()
    with pytest.raises(DeltaspecError, match="exceeds the model's max_position_embeddings \\(2048\\)"):
        plan_for(config.with_settings(max_model_len=8192))
    long = plan_for(config.with_settings(max_model_len=8192, allow_long_max_model_len=True))
    assert long.config.scheduler.max_model_len == 8192
    full = planned.plan  # 8 x 2048 tokens: room for 8 x 1000 tokens of KV in 90 % of the memory instead
    _fixed_memory(monkeypatch, int((full.total - full.kv + 8 * 1000 * full.kv_per_token) / 0.9))
    shortened = plan_for(config)
    ctx = shortened.config.scheduler.max_model_len
    assert shortened.plan.fits and ctx < 2048 and ctx % 16 == 0
    bigger = plan_for(config.with_settings(max_model_len=ctx + 16)).plan  # the longest within 90 % of the free memory
    assert shortened.plan.total <= 0.9 * shortened.plan.available < bigger.total
    assert any("the most that 8 streams fit" in note for note in shortened.plan.notes)
    assert all(ctx <= 2048 for _, ctx in _advised(shortened.plan.table()))


def test_gpu_memory_utilization_fills_its_budget_with_kv_pages(tmp_path, monkeypatch):
    """The KV pool (and without --max-num-seqs the streams) grow to fill the fraction of the device's memory; the
    engine allocates exactly the planned pool, and a pool of more than the streams' contexts serves them."""
    model = str(write_checkpoint(tmp_path / "m", "qwen3_5", max_position_embeddings=256))
    base = plan_for(EngineConfig.from_flat(model=model, dtype="float32", device="cpu", max_num_seqs=1)).plan
    budget = base.total + 50 * 256 * base.kv_per_token
    _fixed_memory(monkeypatch, budget)
    planned = plan_for(EngineConfig.from_flat(model=model, dtype="float32", device="cpu", gpu_memory_utilization=0.5))
    plan, config = planned.plan, planned.config
    assert plan.fits and plan.available == budget  # half of a device twice the free memory
    assert config.cache.num_kv_blocks * config.cache.block_size == plan.kv_tokens >= config.scheduler.max_num_seqs * 256
    assert plan.available - plan.total < 16 * plan.kv_per_token + plan.state_per_stream  # nothing left unused
    assert "budget on cpu" in plan.table() and "KV pool" in plan.table()
    fixed = plan_for(
        EngineConfig.from_flat(model=model, dtype="float32", device="cpu", gpu_memory_utilization=0.5, max_num_seqs=2)
    )
    assert fixed.config.scheduler.max_num_seqs == 2 and fixed.plan.kv_tokens > plan.kv_tokens
    llm = LLM(model, dtype="float32", device="cpu", gpu_memory_utilization=0.5, max_num_seqs=2)
    assert llm.engine.cache.kv.bytes() == llm.engine.plan.kv
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 3, SamplingParams(max_tokens=8, temperature=0))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    with pytest.raises(DeltaspecError, match="only .* GiB is free"):
        plan_for(EngineConfig.from_flat(model=model, dtype="float32", device="cpu", gpu_memory_utilization=0.9))
    with pytest.raises(DeltaspecError, match="not both"):
        plan_for(EngineConfig.from_flat(model=model, device="cpu", gpu_memory_utilization=0.5, num_kv_blocks=64))


def test_plan_command(checkpoints, capsys):
    assert (
        main(
            ["plan", "--model", str(checkpoints["qwen3_5_r2"]), "--device", "cpu", "--max-streams", "4", "--ctx", "256"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "attention KV (4 streams x 256 tokens)" in out and "fits;" in out
    assert (
        main(
            [
                "plan",
                "--model",
                str(checkpoints["qwen3_5_r2"]),
                "--device",
                "cpu",
                "--max-streams",
                "100000",
                "--ctx",
                "512",
            ]
        )
        == 2
    )
    captured = capsys.readouterr()
    assert "does NOT fit" in captured.out and captured.err.startswith("error: ")


def test_kv_pages_scale_with_streams_and_context(checkpoints):
    small = plan_for(
        EngineConfig.from_flat(model=str(checkpoints["qwen3_5_r2"]), device="cpu", max_num_seqs=2, max_model_len=128)
    ).plan
    large = plan_for(
        EngineConfig.from_flat(model=str(checkpoints["qwen3_5_r2"]), device="cpu", max_num_seqs=4, max_model_len=256)
    ).plan
    assert large.kv == 4 * small.kv and large.state_per_stream == small.state_per_stream
    # each stream's slot, three prefix checkpoints per stream by default, and the CUDA-graph scratch slot
    assert (small.states, large.states) == (9 * small.state_per_stream, 17 * small.state_per_stream)
    # 2 attention layers x (K, V) x 2 KV heads x head_dim 16 x float32
    assert small.kv_per_token == 2 * 2 * 2 * 16 * torch.tensor([], dtype=torch.float32).element_size()


def test_plan_counts_the_outputs_of_every_captured_cuda_graph():
    """Buckets 1, 2, 4, 8 sequences x rows 1 (decode) and 2, 4, 5 (verify at draft length 4) each keep
    their hidden states and logits; eager configurations capture nothing."""
    from deltaspec.cache.memory_plan import Workspace, plan_memory
    from deltaspec.config.graph_buckets import captured_rows
    from deltaspec.config.resolve import cache_spec
    from deltaspec.model.shapes import shape_config

    assert captured_rows(8, 0) == 1 + 2 + 4 + 8 and captured_rows(8, 5) == 15 * (1 + 2 + 4 + 5)
    config = shape_config("qwen3.5-0.8b")
    cuda = EngineConfig.from_flat(
        device="cuda", dtype="bfloat16", state_dtype="float32", max_num_seqs=8, speculative="ngram", draft_tokens=4
    )

    def captured(config: EngineConfig) -> int:
        return cache_spec(config, 8, 1024, 0).captured_rows

    assert captured(cuda) == 180
    assert captured(cuda.with_settings(enforce_eager=True)) == 0
    assert captured(cuda.with_settings(kernels="reference")) == 0
    assert captured(cuda.with_settings(device="cpu")) == 0
    plans = [
        plan_memory(
            config,
            replace(cache_spec(config_, 8, 1024, 0), device=torch.device("cpu")),
            10**9,
            Workspace(batch_rows=2048, prefill_chunk=512),
            available=10**12,
        )
        for config_ in (cuda.with_settings(enforce_eager=True), cuda)
    ]
    assert plans[1].workspace - plans[0].workspace == 180 * (config.vocab_size + config.hidden_size) * 2


def test_the_vision_towers_workspace_takes_the_place_of_a_passes_when_larger():
    """The tower encodes between passes: the workspace is the larger of a pass's and an image's, never the sum."""
    from deltaspec.cache.memory_plan import Workspace, plan_memory
    from deltaspec.config.resolve import cache_spec
    from deltaspec.model.shapes import shape_config

    config = shape_config("qwen3.5-0.8b")
    spec = cache_spec(EngineConfig.from_flat(device="cpu", dtype="bfloat16", state_dtype="float32"), 1, 1024, 0)

    def workspace(images: int) -> int:
        rows = Workspace(batch_rows=2048, prefill_chunk=512, images=images)
        return plan_memory(config, spec, 10**9, rows, available=10**12).workspace

    text = workspace(0)
    assert workspace(text // 2) == text and workspace(text * 3) == text * 3


def test_repacking_at_load_is_counted_and_refused_when_it_cannot_fit(monkeypatch):
    """With --repack on CUDA the plan counts what repacking holds while the model loads: the largest Q4_K / Q6_K
    matrix outside the embedding table and MoE layers, as llama-quantize wrote the file, copied, and a pass's
    temporaries; a budget that holds everything but that refuses the configuration, naming --repack."""
    from deltaspec.model.gguf_raw import read_raw
    from deltaspec.ops.quant import repacked

    path = Path(__file__).parents[1] / "data" / "gguf_llama" / "qwen3next-q4_k_m.gguf"
    raw = read_raw(path).tensors
    largest = max(
        repacked.transient_bytes(t.qtype, t.data.nbytes, t.data.shape[-1])
        for name, t in raw.items()
        if t.qtype in repacked.REPACKED and len(t.shape) == 2 and name != "token_embd.weight"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _fixed_memory(monkeypatch, 4 << 30)
    config = EngineConfig.from_flat(model=str(path), device="cuda", max_num_seqs=1, max_model_len=64, repack=True)
    plan = plan_for(config).plan
    assert plan.load_transient == largest and plan.fits
    assert plan_for(config.with_settings(repack=False)).plan.load_transient == 0
    assert plan_for(config.with_settings(device="cpu")).plan.load_transient == 0
    monkeypatch.setattr(repacked, "TEMPORARIES", {"Q4_K": 30000, "Q6_K": 30000})  # a load that outweighs the rest
    heavy = plan_for(config).plan
    _fixed_memory(monkeypatch, heavy.at_load - 1)
    tight = plan_for(config).plan
    assert tight.total <= tight.available < tight.at_load and not tight.fits
    assert "drop --repack" in tight.advice()


def test_repacking_a_random_q4_k_m_shape_counts_its_q6_k_lm_head(monkeypatch):
    """llama-quantize's Q4_K_M gives the 27B shape's untied LM head [248320, 5120] Q6_K, its largest repacked matrix:
    1.07 GiB held at load beside the weights."""
    from deltaspec.ops.quant import repacked

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _fixed_memory(monkeypatch, 80 << 30)
    flags = dict(random_weights=True, shape="qwen3.5-27b", quant="q4_k_m", device="cuda", max_model_len=1024)
    plan = plan_for(EngineConfig.from_flat(**flags, max_num_seqs=2, repack=True)).plan
    head_row = 5120 // 256 * 210
    assert plan.load_transient == repacked.transient_bytes("Q6_K", 248320 * head_row, head_row) and plan.fits
    assert re.search(r"repacking at load \(freed before the caches\) +1\.065 GiB", plan.table())
