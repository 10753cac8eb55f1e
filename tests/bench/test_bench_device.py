"""The device benchmarks (decode, verify, concurrency, prefill, spec-oracle, tree-oracle, drafter, structured) run on
the CPU with the embedded model or a small shape; their JSON has the fields the issue asks for, related by DESIGN §6's
definitions.
Speeds are not checked (CI machines vary), only that they are positive and consistent."""

import json

import pytest
import torch

from deltaspec.bench.device import bench_engine, copy_bandwidth
from deltaspec.bench.roofline import bytes_per_step
from deltaspec.cli import main
from deltaspec.config.engine import EngineConfig, LoadConfig
from deltaspec.errors import DeltaspecError
from deltaspec.sample.params import SamplingParams
from deltaspec.spec.drafter import DraftRequest
from deltaspec.spec.oracle import (
    OracleDrafter,
    expected_acceptance_length,
    parse_profile,
    parse_ranks,
    profile_for_acceptance_length,
)

SMALL_27B = ["--random-weights", "--shape", "qwen3.5-27b"]


def bench(argv, tmp_path, capsys) -> dict:
    out = tmp_path / "report.json"
    assert main(["bench", *argv, "--device", "cpu", "--json", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == report
    assert report["device"] == "cpu" and report["dtype"] and "commit" in report
    return report


def test_bench_decode_reports_the_roofline_consistently(tmp_path, capsys):
    r = bench(["decode", "--context", "4", "--max-tokens", "3", "--runs", "1"], tmp_path, capsys)
    for key in ("decode_tok_s", "step_ms", "bytes_per_step", "bandwidth_gb_s", "roofline_tok_s", "roofline_fraction"):
        assert r[key] > 0, key
    assert r["step_ms"] == pytest.approx(1000 / r["decode_tok_s"])
    assert r["roofline_tok_s"] == pytest.approx(r["bandwidth_gb_s"] * 1e9 / r["bytes_per_step"])
    assert r["roofline_fraction"] == pytest.approx(r["decode_tok_s"] / r["roofline_tok_s"])
    assert r["bytes_per_step"] == sum(r["bytes_per_step_parts"][k] for k in ("weights", "kv", "gdn_state"))
    assert r["roofline_violation"] is False and r["speculative"] == "none" and r["context"] == 4
    assert r["model"].endswith("target") and r["runs"] == 1 and len(r["per_run"]) == 1


def test_bytes_per_step_reads_each_weight_once_and_one_embedding_row():
    engine = bench_engine(EngineConfig.from_flat(device="cpu", dtype="float32"), 32)
    config, model = engine.model_config, engine.model
    unique = {p.data_ptr(): p for n, p in model.named_parameters() if not n.startswith("mtp.")}
    mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    # tied embeddings: the LM head reads the whole table, the embedding lookup one more row
    weights = (sum(p.numel() for p in unique.values()) + config.hidden_size) * 4
    parts = bytes_per_step(engine, context=10)
    assert config.tie_word_embeddings and parts["weights"] == weights
    assert bytes_per_step(engine, 10, mtp=True)["weights"] == weights + mtp * 4
    attention = len(config.attention_layer_ids)
    assert parts["kv"] == 10 * attention * 2 * config.num_key_value_heads * config.head_dim * 4
    state = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    conv = (config.linear_conv_kernel_dim - 1) * config.gdn_conv_dim * 4
    assert parts["gdn_state"] == 2 * len(config.gdn_layer_ids) * (state + conv)
    assert copy_bandwidth(torch.device("cpu"), nbytes=8 << 20, repeats=2) > 0


def test_bench_decode_on_a_small_random_shape(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(LoadConfig, "__init__", _with_small_shape(LoadConfig.__init__))
    r = bench(["decode", *SMALL_27B, "--context", "4", "--max-tokens", "2", "--runs", "1"], tmp_path, capsys)
    assert r["shape"] == "qwen3.5-27b" and r["random_weights"] is True and r["decode_tok_s"] > 0


def _with_small_shape(init):
    """An EngineConfig's load settings, with a --shape cut down for CI (shape_overrides is Python-only, not a CLI
    flag)."""

    def patched(self, *args, **kwargs):
        if kwargs.get("shape") and not kwargs.get("shape_overrides"):
            kwargs["shape_overrides"] = (
                ("num_hidden_layers", 4),
                ("hidden_size", 64),
                ("intermediate_size", 128),
                ("vocab_size", 512),
            )
        init(self, *args, **kwargs)

    return patched


def test_bench_drafter_times_a_random_block_drafter_sized_for_the_shape(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(LoadConfig, "__init__", _with_small_shape(LoadConfig.__init__))
    argv = ["drafter", *SMALL_27B, "--speculative", "block", "--draft-tokens", "3", "--context", "8"]
    r = bench([*argv, "--max-tokens", "8", "--runs", "1"], tmp_path, capsys)
    assert r["speculative"] == "block" and r["draft_tokens"] == 3 and r["shape"] == "qwen3.5-27b"
    assert r["propose_ms"] > 0 and r["plain_step_ms"] > 0 and r["verify_pass_ms"] > 0
    assert r["draft_fraction_of_step"] == pytest.approx(r["propose_ms"] / r["plain_step_ms"])
    assert r["per_run"][0]["proposals"] >= 2
    assert main(["bench", "drafter", *SMALL_27B, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "bench drafter times a drafter: give --speculative" in err and "Traceback" not in err


@pytest.mark.parametrize("constraint", ["json", "text"])
def test_bench_structured_reports_both_speeds_and_the_constraint_time(tmp_path, capsys, constraint):
    argv = ["structured", "--concurrency", "1,3", "--constraint", constraint, "--context", "4", "--max-tokens", "6"]
    r = bench([*argv, "--runs", "1", "--speculative", "ngram", "--draft-tokens", "2"], tmp_path, capsys)
    assert [row["streams"] for row in r["rows"]] == [1, 3] and r["constraint"] == constraint
    for row in r["rows"]:
        assert row["plain_tok_s"] > 0 and row["constrained_tok_s"] > 0 and row["constraint_ms_per_step"] > 0
        assert row["constraint_ms_per_step"] < row["constrained_step_ms"]
        assert row["slowdown"] == pytest.approx(row["plain_tok_s"] / row["constrained_tok_s"])


def test_bench_verify_reports_each_row_count_and_its_ratio(tmp_path, capsys):
    r = bench(["verify", "--context", "4", "--rows", "1,3", "--rounds", "1", "--runs", "1"], tmp_path, capsys)
    assert [row["rows"] for row in r["rows"]] == [1, 3]
    assert r["draft_tokens"] == 2  # the oracle drafter that ran, as the engine resolved it
    assert r["rows"][0]["ratio_to_1_row"] == 1.0
    for row in r["rows"]:
        assert row["step_ms"] > 0 and row["passes"] >= 1
        assert row["ratio_to_1_row"] == pytest.approx(row["step_ms"] / r["rows"][0]["step_ms"])


def test_bench_concurrency_reports_aggregate_by_the_tpot_definition(tmp_path, capsys):
    r = bench(
        ["concurrency", "--context", "6", "--max-tokens", "3", "--concurrency", "1,2", "--runs", "1"], tmp_path, capsys
    )
    assert [level["concurrency"] for level in r["levels"]] == [1, 2]
    assert r["speculative"] == "none" and r["draft_tokens"] is None
    for level in r["levels"]:
        run = level["per_run"][0]
        assert run["aggregate_tok_s"] == pytest.approx(level["concurrency"] * 1000 / run["tpot_ms_mean"])
        assert level["aggregate_tok_s"] == run["aggregate_tok_s"]
    assert r["levels"][0]["ratio_to_single_stream"] == 1.0
    assert r["levels"][1]["ratio_to_single_stream"] == pytest.approx(
        r["levels"][1]["aggregate_tok_s"] / r["levels"][0]["aggregate_tok_s"]
    )
    for level in r["levels"]:
        roofline = level["concurrency"] * r["bandwidth_gb_s"] * 1e9 / level["bytes_per_step"]
        assert level["roofline_tok_s"] == pytest.approx(roofline) and level["moe_experts_per_step"] is None
        assert level["roofline_fraction"] == pytest.approx(level["aggregate_tok_s"] / roofline)
    assert r["levels"][1]["bytes_per_step"] > r["levels"][0]["bytes_per_step"]  # a second stream's KV and state


SMALL_MOE = (("num_hidden_layers", 4), ("hidden_size", 64), ("vocab_size", 512), ("num_experts", 16))


def test_moe_bytes_per_step_count_the_distinct_experts_the_steps_read():
    """One stream's decode step reads its token's top-k experts; several streams' steps read between top-k and
    all of them, as the layers' device counters measure."""
    from deltaspec.bench.device import random_prompt
    from deltaspec.bench.roofline import experts_per_step

    config = EngineConfig.from_flat(
        device="cpu", dtype="float32", random_weights=True, shape="qwen3.5-35b-a3b", shape_overrides=SMALL_MOE
    )
    engine = bench_engine(config, 32, streams=6)
    top_k, num_experts = engine.model_config.moe.num_experts_per_tok, engine.model_config.moe.num_experts
    one = experts_per_step(engine, [random_prompt(engine, 5, 1)], 6)
    many = experts_per_step(engine, [random_prompt(engine, 5, seed) for seed in range(6)], 6)
    assert one == top_k and top_k < many <= num_experts
    single, routed = bytes_per_step(engine, 8, experts=one), bytes_per_step(engine, 8, streams=6, experts=many)
    assert single == bytes_per_step(engine, 8)  # the default is the top-k of one token
    experts = engine.model.model.layers[0].mlp.experts
    per_expert = (experts.gate_up_proj[0].nbytes + experts.down_proj[0].nbytes) * len(engine.model.model.layers)
    expected = single["weights"] + (many - one) * per_expert
    assert routed["weights"] == pytest.approx(expected, abs=len(engine.model.model.layers) * 2)


def test_bench_prefill_reports_length_over_time_to_first_token(tmp_path, capsys):
    r = bench(["prefill", "--lengths", "8,24", "--runs", "1", "--prefill-chunk", "16"], tmp_path, capsys)
    assert [row["length"] for row in r["lengths"]] == [8, 24] and r["prefill_chunk"] == 16
    for row in r["lengths"]:
        assert row["prefill_tok_s"] == pytest.approx(row["length"] / row["ttft_s"]) and row["ttft_s"] > 0


def test_bench_spec_oracle_hits_the_profile_in_float64(tmp_path, capsys):
    """All-accept at k = 2 with 2 full rounds: AL is exactly 2, and the output is the plain greedy one."""
    r = bench(
        [
            "spec-oracle",
            "--oracle-profile",
            "1,1",
            "--context",
            "4",
            "--max-tokens",
            "7",
            "--runs",
            "1",
            "--dtype",
            "float64",
        ],
        tmp_path,
        capsys,
    )
    run = r["per_run"][0]
    assert r["profile"] == [1.0, 1.0] and r["expected_acceptance_length"] == 2.0
    assert r["acceptance_length"] == 2.0 and run["rounds"] == 2 and run["matches_plain"]
    assert r["speedup"] == pytest.approx(r["spec_decode_tok_s"] / r["plain_decode_tok_s"])


def test_oracle_profiles():
    assert expected_acceptance_length([0.5, 0.5]) == 0.5 + 0.25
    profile = profile_for_acceptance_length(3.0, 7)
    assert len(profile) == 7 and expected_acceptance_length(profile) == pytest.approx(3.0, abs=1e-4)
    assert parse_profile("0.9, 0.8") == [0.9, 0.8]
    for bad in ("", "1.5", "a,b"):
        with pytest.raises(DeltaspecError):
            parse_profile(bad)
    with pytest.raises(DeltaspecError, match="impossible"):
        profile_for_acceptance_length(5, 4)


def test_oracle_accepts_at_the_profile_rate_and_its_target_agrees_with_the_reference():
    ref = list(range(100, 140))
    oracle = OracleDrafter(vocab_size=1000, seed=3)
    oracle.expect("s", 2, ref, [0.7, 0.5])
    rights = []
    for n in range(30):  # each round: the context is the prompt + the first n reference tokens
        draft = oracle.propose([DraftRequest("s", [1, 2, *ref[:n]], 2)])[0].tokens
        assert len(draft) == 2 and draft[0] in (ref[n], ref[n] + 1)
        rights.append(draft[0] == ref[n])
        if draft[0] != ref[n]:
            assert draft[1] == ref[n + 1]  # filler after the first wrong token
    assert 0.4 < sum(rights) / len(rights) < 0.95
    again = _fresh(ref)
    assert (
        again.propose([DraftRequest("s", [1, 2], 2)])[0].tokens
        == OracleDrafter.propose(_fresh(ref), [DraftRequest("s", [1, 2], 2)])[0].tokens
    )
    renamed = OracleDrafter(vocab_size=1000, seed=3)
    renamed.expect("another id", 2, ref, [0.7, 0.5])  # a rerun of the prompt drafts the same at the same positions
    assert [renamed.propose([DraftRequest("another id", [1, 2, *ref[:n]], 2)])[0].tokens for n in range(8)] == [
        _fresh(ref).propose([DraftRequest("s", [1, 2, *ref[:n]], 2)])[0].tokens for n in range(8)
    ]
    with pytest.raises(DeltaspecError, match="left the oracle's reference"):
        oracle.propose([DraftRequest("s", [1, 2, 999], 2)])
    assert oracle.propose([DraftRequest("unexpected", [1, 2], 2)])[0].tokens == []  # decodes plainly
    # the prompt has 2 tokens: position 2 is the reference's first token; past the reference the pass's own argmax
    assert oracle.agree("s", [2, 3, 5, 41, 42], [7, 7, 7, 7, 7]) == [ref[0], ref[1], ref[3], ref[39], 7]
    assert oracle.agree("unexpected", [2, 3], [7, 8]) == [7, 8]


@pytest.mark.parametrize("tree", [0, 6], ids=["chain", "tree"])
def test_the_oracle_engine_commits_its_reference_whatever_the_model_would_pick(tree):
    """The argmax of a followed sequence's rows is the reference's token after each row's path, so a run commits the
    reference even where the model picks other tokens (here: random ones), a tree's accepted paths included, at the
    profile's acceptance; a sequence the oracle does not follow decodes as the model does."""
    from deltaspec.bench.decode import oracle_engine
    from deltaspec.bench.device import drive, random_prompt, run, start

    engine, oracle = oracle_engine(EngineConfig.from_flat(device="cpu", dtype="float32"), 64, 5, tree=tree)
    prompt = random_prompt(engine, 8, seed=0)
    plain = run(engine, [prompt], 24)[0].output_ids
    reference = random_prompt(engine, 24, seed=1)
    seq = start(engine, [prompt], 24)[0]
    oracle.expect(seq.request.request_id, len(prompt), reference, [0.8] * 5, ranks=[0.5, 0.3, 0.1] if tree else None)
    drive(engine, [seq])
    stats = seq.stats.acceptance
    assert seq.output_ids == reference != plain
    assert stats.rounds >= 4 and stats.accepted >= stats.rounds  # drafts were accepted: more than one a round
    assert engine.speculator.tree_rounds == (stats.rounds if tree else 0)
    assert run(engine, [prompt], 24)[0].output_ids == plain


def test_oracle_trees_put_the_right_token_at_each_rank_at_its_rate():
    """Per position the right token is the candidate of rank j with probability ranks[j] (none with the rest), the
    candidates carry the profile as their probabilities, and the chain is the first ranks; after a position without
    the right token nothing deeper matters."""
    ref, ranks = list(range(100, 400)), [0.5, 0.3, 0.1]
    oracle = OracleDrafter(vocab_size=1000, seed=4)
    oracle.expect("s", 2, ref, [0.0] * 3, ranks=ranks)
    found = [0, 0, 0, 0]  # rank of the right token at the first position, 3: absent
    for n in range(250):
        draft = oracle.propose([DraftRequest("s", [1, 2, *ref[:n]], 3, candidates=4)])[0]
        assert len(draft.candidates) == 3 and [p for _, p in draft.candidates[0]] == ranks
        assert draft.tokens == [c[0][0] for c in draft.candidates]
        tokens = [t for t, _ in draft.candidates[0]]
        assert len(set(tokens)) == 3
        found[tokens.index(ref[n]) if ref[n] in tokens else 3] += 1
    assert [abs(f / 250 - p) < 0.1 for f, p in zip(found, ranks + [0.1])] == [True] * 4
    chain = OracleDrafter(vocab_size=1000, seed=4)
    chain.expect("s", 2, ref, [0.5] * 3, ranks=ranks)
    assert chain.propose([DraftRequest("s", [1, 2], 3)])[0].candidates is None  # no tree asked: the chain's draft
    assert parse_ranks("0.6,0.2") == [0.6, 0.2]
    for bad in ("0.6,0.5", "0.2,0.6"):
        with pytest.raises(DeltaspecError, match="per-rank"):
            parse_ranks(bad)


def test_bench_tree_oracle_compares_a_tree_with_a_chain_of_as_many_rows(tmp_path, capsys):
    """Every full-depth step verified the given rows in both shapes, both committed the reference, and the report
    gives the expected tree (its shape and AL from the per-rank profile), the step and speed ratios and the tree's
    memory."""
    argv = ["tree-oracle", "--rows", "6", "--oracle-ranks", "0.5,0.3,0.1", "--context", "8", "--max-tokens", "24"]
    r = bench([*argv, "--runs", "1", "--dtype", "bfloat16"], tmp_path, capsys)
    run = r["per_run"][0]
    assert r["verify_rows"] == 6 and len(r["tree_parents"]) == 6
    assert r["tree"]["expected_acceptance_length"] > r["chain"]["expected_acceptance_length"]
    assert run["tree"]["matches_plain"] and run["chain"]["matches_plain"]
    assert run["tree"]["verify_steps"] > 0 and run["chain"]["verify_steps"] > 0
    assert r["tree_step_over_chain_step"] == pytest.approx(r["tree"]["verify_step_ms"] / r["chain"]["verify_step_ms"])
    assert r["tree_speedup_over_chain"] == pytest.approx(r["tree"]["decode_tok_s"] / r["chain"]["decode_tok_s"])
    for shape in ("chain", "tree"):
        report = r[shape]
        assert report["round_rate_tok_s"] == pytest.approx(
            1000 * (report["acceptance_length"] + 1) / report["verify_step_ms"]
        )
    memory = r["workspace"]
    assert memory["per_node_snapshot_bytes_per_sequence"] == 5 * memory["state_bytes_per_sequence"]
    assert memory["recurrence_restarts"] >= 1 and 0 < memory["tree_tensors_bytes_per_pass"] < 1024


def _fresh(ref):
    oracle = OracleDrafter(vocab_size=1000, seed=3)
    oracle.expect("s", 2, ref, [0.7, 0.5])
    return oracle


def test_a_context_beyond_the_model_is_a_clear_error(capsys):
    assert main(["bench", "decode", "--device", "cpu", "--context", "5000", "--max-tokens", "4", "--runs", "1"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the model's 4096 positions" in err and "Traceback" not in err


def test_compare_hf_runs_transformers_on_the_same_weights(tmp_path, capsys):
    """transformers, given the engine's own weight memory, decodes the same greedy tokens; the report has its rate."""
    from deltaspec.bench.hf_compare import hf_model

    engine = bench_engine(EngineConfig.from_flat(device="cpu", dtype="float32"), 32)
    model = hf_model(engine)
    storages = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
    assert all(p.untyped_storage().data_ptr() in storages for p in model.parameters())  # views, no copies
    prompt = [5, 17, 300, 42, 9]
    seq = engine.add_request("r", None, prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0
        )
    assert out[0, len(prompt) :].tolist() == seq.output_ids
    r = bench(["decode", "--context", "4", "--max-tokens", "16", "--runs", "1", "--compare-hf"], tmp_path, capsys)
    assert r["hf_decode_tok_s"] > 0 and r["hf_class"] == "Qwen3_5ForCausalLM"
    assert r["speedup_vs_hf"] == pytest.approx(r["decode_tok_s"] / r["hf_decode_tok_s"])
    assert isinstance(r["fla_importable"], bool) and isinstance(r["hf_fallbacks"], list)


def test_bench_profile_lists_where_decode_steps_spend_their_time(tmp_path, capsys):
    r = bench(["profile", "--context", "8", "--streams", "2", "--steps", "2", "--top", "5"], tmp_path, capsys)
    assert r["benchmark"] == "profile" and r["time_kind"] == "cpu" and r["streams"] == 2
    kernels = r["kernels"]
    assert 0 < len(kernels) <= 5 and r["profiled_ms_per_step"] > 0
    assert r["step_ms"] > 0 and r["graph_replay_ms"] is None  # no CUDA graphs on the CPU
    assert all(k["calls"] > 0 and k["total_ms"] > 0 for k in kernels)
    assert kernels == sorted(kernels, key=lambda k: -k["total_ms"])
    assert 0 < sum(k["share"] for k in kernels) <= 1 + 1e-9
    for k in kernels:
        assert k["us_per_step"] == pytest.approx(1000 * k["total_ms"] / 2)
    assert any(k["name"] in ("aten::mm", "aten::addmm", "aten::linear") for k in kernels)
    assert r["kernels_per_step"] >= len(kernels) / 2 and r["product_ms_per_step"] > 0
    assert r["product_ms_per_step"] + r["non_product_ms_per_step"] == pytest.approx(r["profiled_ms_per_step"])
    assert r["host_ms_not_hidden_per_step"] == pytest.approx(max(r["step_ms"] - r["profiled_ms_per_step"], 0.0))


def test_profile_tells_weight_products_from_the_rest():
    """Kernel names as an H200 profile of a 27B step listed them (benchmarks/h200/0f50148)."""
    from deltaspec.bench.profile import is_product, product_kernel_names

    products = [
        "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT",
        "std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, __nv_bfloat16>",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>",
        "_skinny_kernel",
        "_gate_up_kernel",
        "_down_kernel",
        "q4_k_gemv_kernel",
        "i4_gemv_kernel",
        "_q4_k_tile_kernel",
    ]
    others = [
        "_add_rms_norm_kernel",
        "_paged_attention_kernel",
        "_recurrent_kernel",
        "_route_kernel",
        "_write_kv_kernel",
        "void at::native::vectorized_elementwise_kernel<8, at::native::sigmoid_kernel_cuda>",
        "void at::native::(anonymous namespace)::indexSelectSmallIndex<c10::BFloat16, long>",
    ]
    assert all(is_product(name, on_device=True) for name in products)
    assert not any(is_product(name, on_device=True) for name in others)
    assert {"q4_k_gemv_kernel", "fp8_b128_gemv_kernel", "_pair_gate_up_kernel"} <= product_kernel_names()
    assert is_product("aten::mm", on_device=False) and not is_product("aten::mul", on_device=False)
