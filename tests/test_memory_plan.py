"""The memory planner counts what the engine really allocates, and refuses what does not fit."""

from dataclasses import replace

import pytest
import torch

from deltaspec import LLM, DeltaspecError
from deltaspec.cli import main
from deltaspec.config import EngineConfig
from deltaspec.engine.planning import plan_for


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
        EngineConfig(
            model=str(checkpoints["qwen3_next_r3_moe"]), dtype="float32", device="cpu", max_num_seqs=3, max_model_len=64
        )
    ).plan
    assert llm.engine.plan.states > plain.states and llm.engine.plan.kv == plain.kv


def test_plan_with_mtp_counts_its_kv_layer_as_the_drafters():
    config = EngineConfig(dtype="bfloat16", device="cpu", max_num_seqs=2, max_model_len=64, speculative="mtp")
    plan = plan_for(config).plan
    llm = LLM(**{f: getattr(config, f) for f in ("dtype", "device", "max_num_seqs", "max_model_len", "speculative")})
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
    tight = replace(
        plan, available=plan.total - plan.padded_ctx * plan.drafter.kv_per_token - plan.drafter.state_per_stream
    )  # one stream's share of the drafter short
    assert not tight.fits and "drafter" in tight.refusal()
    assert tight.max_streams() == 1 and replace(tight, streams=1).fits  # the draft model's share counted per stream


def test_a_configuration_that_does_not_fit_is_refused_with_what_would(checkpoints):
    config = EngineConfig(
        model=str(checkpoints["qwen3_5_r2"]),
        dtype="float32",
        device="cpu",
        max_num_seqs=100_000,
        max_model_len=1_000_000,
    )
    plan = plan_for(config).plan
    assert not plan.fits
    with pytest.raises(DeltaspecError) as err:
        LLM(
            str(checkpoints["qwen3_5_r2"]), dtype="float32", device="cpu", max_num_seqs=100_000, max_model_len=1_000_000
        )
    message = str(err.value)
    assert "\n" not in message and message.endswith("would fit.")
    assert f"{plan.max_streams()} streams at 1000000 tokens" in message
    assert f"100000 streams at {plan.max_ctx()} tokens" in message
    assert replace(plan, streams=plan.max_streams()).fits and not replace(plan, streams=plan.max_streams() + 1).fits
    assert replace(plan, ctx=plan.max_ctx()).fits and not replace(plan, ctx=plan.max_ctx() + plan.block_size).fits


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
                "1000000",
            ]
        )
        == 2
    )
    captured = capsys.readouterr()
    assert "does NOT fit" in captured.out and captured.err.startswith("error: ")


def test_kv_pages_scale_with_streams_and_context(checkpoints):
    small = plan_for(
        EngineConfig(model=str(checkpoints["qwen3_5_r2"]), device="cpu", max_num_seqs=2, max_model_len=128)
    ).plan
    large = plan_for(
        EngineConfig(model=str(checkpoints["qwen3_5_r2"]), device="cpu", max_num_seqs=4, max_model_len=256)
    ).plan
    assert large.kv == 4 * small.kv and large.state_per_stream == small.state_per_stream
    # each stream's slot, three prefix checkpoints per stream by default, and the CUDA-graph scratch slot
    assert (small.states, large.states) == (9 * small.state_per_stream, 17 * small.state_per_stream)
    # 2 attention layers x (K, V) x 2 KV heads x head_dim 16 x float32
    assert small.kv_per_token == 2 * 2 * 2 * 16 * torch.tensor([], dtype=torch.float32).element_size()


def test_plan_counts_the_outputs_of_every_captured_cuda_graph():
    """Buckets 1, 2, 4, 8 sequences x rows 1 (decode) and 2, 4, 5 (verify at draft length 4) each keep
    their hidden states and logits; eager configurations capture nothing."""
    from deltaspec.cache.memory_plan import plan_memory
    from deltaspec.execution.graph_buckets import captured_rows, graph_rows_of
    from deltaspec.model.shapes import shape_config

    assert captured_rows(8, 0) == 1 + 2 + 4 + 8 and captured_rows(8, 5) == 15 * (1 + 2 + 4 + 5)
    config = shape_config("qwen3.5-0.8b")
    cuda = EngineConfig(device="cuda", max_num_seqs=8, speculative="ngram", draft_tokens=4)
    assert graph_rows_of(cuda, config) == 180
    assert graph_rows_of(replace(cuda, enforce_eager=True), config) == 0
    assert graph_rows_of(replace(cuda, kernels="reference"), config) == 0
    assert graph_rows_of(replace(cuda, device="cpu"), config) == 0
    plans = [
        plan_memory(
            config,
            6,
            10**9,
            torch.bfloat16,
            torch.float32,
            8,
            1024,
            16,
            2048,
            512,
            torch.device("cpu"),
            available=10**12,
            graph_rows=rows,
        )
        for rows in (0, 180)
    ]
    assert plans[1].workspace - plans[0].workspace == 180 * (config.vocab_size + config.hidden_size) * 2
