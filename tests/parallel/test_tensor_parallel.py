"""Tensor parallelism on the CPU (gloo, spawned workers), in float64: 2 ranks (and 4 where the tiny model's heads
divide) give the logits and tokens of one process for dense, MoE and MTP models; greedy speculative decoding stays
token-identical (rejected drafts roll back on every rank); prefix checkpoints resume under it; a dead worker takes
the server down with a message instead of hanging; layouts that do not divide are refused."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from deltaspec import LLM, SamplingParams
from deltaspec.errors import DeltaspecError
from deltaspec.model.hf_config import parse_model_config, read_config_json
from deltaspec.parallel.shard import Shard, shard_config, valid_sizes
from tests.tiny_models import add_mtp_weights, write_checkpoint

OPTIONS = dict(dtype="float64", device="cpu", max_num_seqs=4, max_model_len=512)
PROMPTS = [[1, 5, 9, 200, 33, 7], list(range(40, 75)), [3] * 9 + [400, 401]]
LOGPROBS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=4, prompt_logprobs=3)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def generate(path: Path, tp: int, params: SamplingParams, prompts=PROMPTS, **options):
    llm = LLM(str(path), tensor_parallel_size=tp, **(OPTIONS | options))
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.close()


def assert_same_logprobs(got: list[dict] | None, want: list[dict] | None) -> None:
    assert (got is None) == (want is None)
    for a, b in zip(got or [], want or []):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.keys() == b.keys()
            for token in a:
                assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-9)


def assert_same_outputs(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert_same_logprobs(a.outputs[0].logprobs, b.outputs[0].logprobs)
        assert_same_logprobs(a.prompt_logprobs, b.prompt_logprobs)


@pytest.fixture(scope="module")
def with_mtp(checkpoints, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tp") / "with_mtp"
    shutil.copytree(checkpoints["qwen3_5_r2"], path)
    add_mtp_weights(path, seed=5)
    return path


@pytest.mark.parametrize("name", ["qwen3_5_r2", "qwen3_5_r1_tied", "qwen3_next_r3_moe", "qwen3_5_moe_r2"])
def test_two_ranks_give_the_logits_of_one(checkpoints, name):
    """Dense (both embeddings), MoE with either GDN layout: every prompt and output logprob within 1e-9."""
    want = generate(checkpoints[name], 1, LOGPROBS)
    assert_same_outputs(generate(checkpoints[name], 2, LOGPROBS), want)


def fused_experts(source: Path, target: Path) -> Path:
    """A copy of checkpoint `source` whose per-expert tensors are stacked as some releases store them: gate_up_proj
    [E, H, 2I] and down_proj [E, I, H] (both transposed against deltaspec's layout)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    (file,) = target.glob("*.safetensors")
    tensors, stacks = load_file(file), {}
    for name in sorted(tensors):
        if match := re.match(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name):
            stacks.setdefault((match[1], match[3]), {})[int(match[2])] = tensors.pop(name)
    for prefix in {prefix for prefix, _ in stacks}:
        gate, up, down = (stacks[(prefix, proj)] for proj in ("gate_proj", "up_proj", "down_proj"))
        experts = range(len(gate))
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([gate[e], up[e]]).T for e in experts]).contiguous()
        tensors[f"{prefix}.down_proj"] = torch.stack([down[e].T for e in experts]).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("name", ["qwen3_next_r3_moe", "qwen3_5_moe_r2", "fused"])
def test_expert_parallel_ranks_give_the_logits_of_one(checkpoints, tmp_path, name):
    """Each rank holds 3 of the 6 experts whole (read from per-expert tensors, or slices of stacked ones) and adds
    the chosen ones it holds: the logprobs of one process within 1e-9."""
    path = checkpoints.get(name) or fused_experts(checkpoints["qwen3_5_moe_r2"], tmp_path / "fused")
    want = generate(path, 1, LOGPROBS)
    llm = LLM(str(path), tensor_parallel_size=2, enable_expert_parallel=True, **OPTIONS)
    try:
        experts = llm.engine.model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.shape[:2] == (3, 2 * 32) and experts.down_proj.shape[0] == 3  # 3 whole experts
        got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], LOGPROBS)
    finally:
        llm.close()
    assert_same_outputs(got, want)


def test_four_ranks_give_the_logits_of_one(tmp_path):
    heads = dict(num_attention_heads=4, num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=8)
    path = write_checkpoint(tmp_path / "wide", "qwen3_5_moe", seed=11, **heads)
    assert 4 in valid_sizes(parse_model_config(read_config_json(path)))
    assert_same_outputs(generate(path, 4, LOGPROBS), generate(path, 1, LOGPROBS))


def test_ranks_outnumbering_the_kv_heads_hold_the_kv_head_their_queries_read(tmp_path):
    """4 ranks over 2 KV heads (vLLM's replication): ranks 0-1 hold KV head 0 whole, ranks 2-3 head 1, each with its
    quarter of the query heads; the logprobs of one process within 1e-9 (and 2 ranks over 1 KV head alike)."""
    heads = dict(num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=8)
    path = write_checkpoint(tmp_path / "gqa", "qwen3_5", seed=12, **heads)
    config = parse_model_config(read_config_json(path))
    assert 4 in valid_sizes(config) and shard_config(config, 4).num_key_value_heads == 1
    name, shape = "model.layers.3.self_attn.k_proj.weight", torch.Size([2 * config.head_dim, config.hidden_size])
    held = [Shard(config, rank, 4).pieces(name, shape) for rank in range(4)]
    head = config.head_dim
    assert held == [(0, ((0, head),))] * 2 + [(0, ((head, 2 * head),))] * 2
    assert_same_outputs(generate(path, 4, LOGPROBS), generate(path, 1, LOGPROBS))
    one = write_checkpoint(tmp_path / "mqa", "qwen3_5", seed=13, num_key_value_heads=1)
    assert_same_outputs(generate(one, 2, LOGPROBS), generate(one, 1, LOGPROBS))


def test_a_script_on_standard_input_starts_ranks_again_after_its_first_engine_is_dropped(checkpoints):
    """The followers start from their own module, not from the caller's `__main__` (here: standard input, which a
    spawned process could not re-read), and an engine dropped without close() ends its group, so the same process
    can start another tensor-parallel engine."""
    script = f"""
from deltaspec import LLM, SamplingParams
greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
for _ in range(2):
    llm = LLM({str(checkpoints["qwen3_5_r2"])!r}, tensor_parallel_size=2, dtype="float64", device="cpu")
    print(llm.generate([{{"prompt_token_ids": [1, 5, 9]}}], greedy)[0].outputs[0].token_ids)
    del llm
"""
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = done.stdout.splitlines()
    assert first == second and len(eval(first)) == 6


GGUF = Path(__file__).parents[1] / "data" / "gguf"


def test_gguf_files_split_whole_blocks_among_ranks(tmp_path):
    """A llama.cpp-converted Q8_0 file and a deltaspec-written Q4_K_M MoE file: each rank keeps its rows and whole
    blocks of input columns (logprobs within 1e-9 of one process); a file whose blocks would straddle two ranks (the
    converted MoE fixture's 32-input Q8_0 blocks over a 32-wide expert) is refused with what would work; with expert
    parallelism the written file's ranks hold whole experts."""
    from deltaspec.model.gguf_write import write_gguf
    from deltaspec.model.gguf_write_source import open_source
    from tools.make_gguf_fixtures import give_qwen_pre_tokenizer
    from tools.make_gguf_write_oracles import WIDE_MOE

    converted, prompts = GGUF / "qwen35-q8_0.gguf", PROMPTS[:2]  # the fixtures' vocabulary is 400 ids
    assert_same_outputs(generate(converted, 2, LOGPROBS, prompts), generate(converted, 1, LOGPROBS, prompts))
    wide = dict(WIDE_MOE, moe_intermediate_size=512, shared_expert_intermediate_size=512, head_dim=128)
    wide |= dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_value_head_dim=128)  # tiled v heads
    checkpoint = write_checkpoint(tmp_path / "moe", "qwen3_5_moe", seed=4, tokenizer=True, **wide)
    give_qwen_pre_tokenizer(checkpoint, "qwen35")
    written = tmp_path / "moe-q4_k_m.gguf"
    write_gguf(open_source(str(checkpoint)), written, "Q4_K_M", progress=False)
    want_written = generate(written, 1, LOGPROBS, prompts)
    assert_same_outputs(generate(written, 2, LOGPROBS, prompts), want_written)
    with pytest.raises(DeltaspecError, match=r"experts\.down_proj \(Q8_0, blocks of 32 inputs\) cannot be split"):
        LLM(str(GGUF / "qwen35moe-q8_0.gguf"), tensor_parallel_size=2, **OPTIONS)
    assert_same_outputs(generate(written, 2, LOGPROBS, prompts, enable_expert_parallel=True), want_written)


LLAMA_MADE = Path(__file__).parents[1] / "data" / "gguf_llama"


def test_a_llama_quantized_moe_file_splits_among_ranks():
    """A file llama-quantize wrote and llama-gguf-split cut in parts (its Q8_0 preset of a Qwen3.5-MoE model with a
    quantized NextN block): with two ranks, and with two ranks holding whole experts, the logprobs of one process
    within 1e-9."""
    path, prompts = LLAMA_MADE / "qwen35moe-q8_0-00001-of-00004.gguf", PROMPTS[:2]  # the vocabulary is 400 ids
    want = generate(path, 1, LOGPROBS, prompts)
    assert_same_outputs(generate(path, 2, LOGPROBS, prompts), want)
    assert_same_outputs(generate(path, 2, LOGPROBS, prompts, enable_expert_parallel=True), want)


def test_the_mtp_head_drafts_alike_and_speculation_stays_exact(with_mtp):
    """The sharded MTP head proposes what one process's does (the same acceptance, draft by draft), and greedy
    speculative output equals plain greedy output with rejected drafts rolled back on both ranks (a random head's
    drafts are rejected; the n-gram test below has them accepted)."""
    plain = generate(with_mtp, 1, GREEDY)
    one = generate(with_mtp, 1, GREEDY, speculative="mtp", draft_tokens=3)
    two = generate(with_mtp, 2, GREEDY, speculative="mtp", draft_tokens=3)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in plain]
    for a, b in zip(two, one):
        assert (
            a.metrics["drafted_at"] == b.metrics["drafted_at"] and a.metrics["accepted_at"] == b.metrics["accepted_at"]
        )
    drafted = sum(sum(o.metrics["drafted_at"]) for o in two)
    assert drafted > sum(o.metrics["spec_accepted_tokens"] for o in two)  # rejected drafts rolled back


def test_ngram_speculation_and_sampling_agree_across_ranks(checkpoints):
    path = checkpoints["qwen3_next_r3_moe"]
    repetitive = [[7, 8, 9, 10] * 6, [100, 101, 102] * 8]
    longer = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)  # its output repeats itself by then
    plain = generate(path, 1, longer, prompts=repetitive)
    spec = generate(path, 2, longer, prompts=repetitive, speculative="ngram", draft_tokens=4)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.get("spec_accepted_tokens", 0) for o in spec) > 0  # accepted drafts folded into the states
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    want = generate(path, 1, sampled, prompts=repetitive)
    assert [o.outputs[0].token_ids for o in generate(path, 2, sampled, prompts=repetitive)] == [
        o.outputs[0].token_ids for o in want
    ]


def test_a_draft_model_drafts_whole_on_every_rank(checkpoints):
    """The target drafting for itself (a replicated draft model): drafts accepted, output that of plain greedy."""
    path = checkpoints["qwen3_5_moe_r2"]
    plain = generate(path, 1, GREEDY)
    spec = generate(path, 2, GREEDY, speculative="draft", draft_model=str(path), draft_tokens=3)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics["spec_accepted_tokens"] for o in spec) > 0


def test_prefix_checkpoints_resume_under_tensor_parallelism(checkpoints):
    path, doc = checkpoints["qwen3_5_r2"], [(13 * i + 5) % 480 + 3 for i in range(300)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    llm = LLM(str(path), tensor_parallel_size=2, prefix_checkpoint_min_prompt=128, **OPTIONS)
    try:
        first = llm.generate([{"prompt_token_ids": doc}], params)[0]
        follow_up = doc + first.outputs[0].token_ids + [11, 12, 13]
        resumed = llm.generate([{"prompt_token_ids": follow_up}], params)[0]
    finally:
        llm.close()
    assert resumed.num_cached_tokens == len(doc) + len(first.outputs[0].token_ids) - 1
    assert_same_outputs([resumed], generate(path, 1, params, prompts=[follow_up], enable_prefix_caching=False))


def test_each_rank_reads_its_pieces_of_every_split_weight(checkpoints):
    config = parse_model_config(read_config_json(checkpoints["qwen3_5_r2"]))
    key, value = (
        config.linear_num_key_heads * config.linear_key_head_dim,
        config.gdn_conv_dim - 2 * (config.linear_num_key_heads * config.linear_key_head_dim),
    )
    qkv = torch.arange(config.gdn_conv_dim).unsqueeze(1).expand(-1, 3)
    halves = [
        Shard(config, rank, 2).take("model.layers.0.linear_attn.in_proj_qkv.weight", qkv)[:, 0] for rank in (0, 1)
    ]
    assert halves[0].tolist() == [*range(key // 2), *range(key, key + key // 2), *range(2 * key, 2 * key + value // 2)]
    assert sorted(halves[0].tolist() + halves[1].tolist()) == list(range(config.gdn_conv_dim))
    o_proj = torch.arange(12.0).view(2, 6)
    assert Shard(config, 1, 2).take("model.layers.3.self_attn.o_proj.weight", o_proj).tolist() == [
        [3.0, 4.0, 5.0],
        [9.0, 10.0, 11.0],
    ]
    bias = torch.ones(4)
    assert Shard(config, 1, 2).take("model.layers.3.self_attn.o_proj.bias", bias).tolist() == [0.0] * 4
    assert Shard(config, 1, 2).take("model.norm.weight", bias) is bias
    rank_config = shard_config(config, 2)
    assert (rank_config.num_key_value_heads, rank_config.linear_num_value_heads) == (1, 2)
    assert rank_config.vocab_size == config.vocab_size  # the embedding and the LM head divide it themselves


def test_layouts_that_do_not_divide_are_refused_with_what_would(checkpoints):
    with pytest.raises(
        DeltaspecError, match=r"Tensor parallel size 3 does not divide .*num_attention_heads \(4\).*: 1, 2"
    ):
        LLM(str(checkpoints["qwen3_5_r2"]), tensor_parallel_size=3, **OPTIONS)
    command = [sys.executable, "-m", "deltaspec.cli", "plan", "--random-weights", "--shape", "qwen3.5-0.8b"]
    command += ["--device", "cpu", "--max-model-len", "4096", "--max-num-seqs", "1"]
    out = subprocess.run([*command, "-tp", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "one rank's" in out.stdout, out.stderr
    out = subprocess.run([*command, "-tp", "5"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "does not divide" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([*command, "-tp", "2", "-ep"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "this model has none" in out.stderr and "Traceback" not in out.stderr
    moe = [*command[:6], "qwen3.5-35b-a3b", *command[7:]]
    tensor = subprocess.run([*moe, "-tp", "2"], capture_output=True, text=True, timeout=120)
    experts = subprocess.run([*moe, "-tp", "2", "-ep"], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in tensor.stderr + experts.stderr  # (this host may lack the memory: the plan says so)
    assert "experts split whole" in experts.stdout and "experts split whole" not in tensor.stdout
    moe_config = parse_model_config(read_config_json(checkpoints["qwen3_5_moe_r2"]))
    with pytest.raises(DeltaspecError, match=r"does not divide the model's .*num_experts \(6\)"):
        shard_config(moe_config, 4, expert_parallel=True)
    assert [Shard(moe_config, 1, 2, expert_parallel=True).held_expert(e) for e in range(6)] == [None] * 3 + [0, 1, 2]
    held = shard_config(moe_config, 2, expert_parallel=True).moe
    assert (held.held_experts, held.moe_intermediate_size) == (3, moe_config.moe.moe_intermediate_size)


def test_what_runs_on_one_device_only_says_so(checkpoints):
    from deltaspec.bench.decode import bench_decode
    from deltaspec.config.engine import EngineConfig
    from deltaspec.evaluate_kl import scoring_config

    config = EngineConfig.from_flat(model=str(checkpoints["qwen3_5_r2"]), device="cpu", tensor_parallel_size=2)
    with pytest.raises(DeltaspecError, match="KL scoring and imatrix calibration run on one device"):
        scoring_config(config, 64)
    with pytest.raises(DeltaspecError, match="--compare-hf runs transformers on one device"):
        bench_decode(config, 8, 4, 1, compare_hf=True)
    with pytest.raises(DeltaspecError, match="--quant runs on one device"):
        LLM(random_weights=True, shape="qwen3.5-0.8b", quant="q4_k_m", tensor_parallel_size=2, device="cpu")


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the worker through /proc")
def test_a_dead_worker_stops_the_server_with_a_message(checkpoints):
    command = [sys.executable, "-m", "deltaspec.cli", "serve", "--model", str(checkpoints["qwen3_5_r2"])]
    command += ["--device", "cpu", "--dtype", "float64", "--port", "0", "-tp", "2", "--max-streams", "2"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
    try:
        port = int(re.search(r":(\d+)/v1", server.stdout.readline()).group(1))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as response:
            assert json.loads(response.read())["data"]
        cmdlines = {pid: Path(f"/proc/{pid}/cmdline").read_text() for pid in _children(server.pid)}
        workers = [pid for pid, cmdline in cmdlines.items() if "deltaspec.engine.follower" in cmdline]
        os.kill(workers[0], signal.SIGKILL)
        started = time.monotonic()
        server.wait(timeout=30)
        assert time.monotonic() - started < 30
        assert server.returncode != 0
        assert "tensor-parallel worker rank 1 exited" in server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_capture_the_collectives_in_cuda_graphs(checkpoints):
    """NCCL all-reduces and all-gathers inside the decode graphs: the same tokens and logprobs as eager passes on two
    GPUs, and the tokens of one GPU (float32: the sums run in another order, so logprobs agree to 1e-4)."""
    path, options = checkpoints["qwen3_5_moe_r2"], dict(dtype="float32", device="cuda")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    graphs = generate(path, 2, params, **options)
    eager = generate(path, 2, params, enforce_eager=True, **options)
    one = generate(path, 1, params, **options)
    for got, want, bound in ((graphs, eager, 1e-6), (graphs, one, 1e-4)):
        for a, b in zip(got, want, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert {t: lp.logprob for t, lp in lp_a.items()} == pytest.approx(
                    {t: lp.logprob for t, lp in lp_b.items()}, abs=bound
                )


def test_the_step_digest_tells_diverged_ranks_apart():
    """What a worker checks before each step: the same running sequences, output lengths and last tokens."""
    from types import SimpleNamespace

    from deltaspec.engine.workers import digest

    def running(*outputs):
        return [
            SimpleNamespace(request=SimpleNamespace(request_id=f"r{i}"), output_ids=list(o))
            for i, o in enumerate(outputs)
        ]

    assert digest(running([1, 2], [3])) == digest(running([1, 2], [3]))
    assert digest(running([1, 2], [3])) != digest(running([1, 4], [3]))  # another last token
    assert digest(running([1, 2], [3])) != digest(running([1, 2], [3, 3]))  # another length
    assert digest(running([1, 2])) != digest(running([1, 2], []))  # another set of sequences


def torchrun(tmp_path: Path, *argv: str, nproc: int = 2, env: dict | None = None) -> subprocess.CompletedProcess:
    """`deltaspec ARGV` as torchrun starts it: `nproc` ranks on this host, rendezvous on a free port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}"]
    return subprocess.run(
        [*command, "-m", "deltaspec.cli", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=os.environ | {"OMP_NUM_THREADS": "1"} | (env or {}),
    )


def test_ranks_torchrun_starts_serve_one_engine_and_only_rank_0_runs_the_command(checkpoints, tmp_path, capsys):
    """torchrun's env:// rendezvous (what several nodes use): rank 0 prints the completion a single process prints,
    rank 1 only follows; a tensor-parallel size that is not the launcher's world size is one sentence."""
    from deltaspec.cli import main

    path = tmp_path / "model"
    shutil.copytree(checkpoints["qwen3_5_r2"], path)
    from tests.tiny_tokenizer import write_tiny_tokenizer

    write_tiny_tokenizer(path)
    argv = ["generate", "--model", str(path), "--device", "cpu", "--dtype", "float64", "--max-model-len", "256"]
    argv += ["--max-tokens", "10", "--temperature", "0", "--ignore-eos", "def add(a, b):"]
    assert main(argv) == 0
    single = capsys.readouterr().out
    out = torchrun(tmp_path, *argv, "--tensor-parallel-size", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == single and single.startswith("def add(a, b):")  # printed once: rank 1 ran no command
    wrong = torchrun(tmp_path, *argv)
    assert wrong.returncode != 0 and "give --tensor-parallel-size 2" in wrong.stderr
