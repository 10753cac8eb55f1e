"""Pipeline parallelism on the CPU (gloo, spawned or torchrun-started ranks), in float64: 2 stages, and 2 stages of 2
tensor-parallel ranks, give one process's tokens and logprobs within 1e-9 with speculative decoding (MTP drafts
rejected and rolled back on every stage, a draft model's accepted), prefix checkpoints and micro-batches; each stage
holds and caches its own layers only; a dead stage stops the server with a sentence; sizes that cannot work are
refused in one sentence."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from deltaspec import LLM, SamplingParams
from deltaspec.config.engine import EngineConfig
from deltaspec.engine.planning import plan_for
from deltaspec.errors import DeltaspecError
from deltaspec.execution.pipeline_pass import micro_batches
from deltaspec.model.decoder import OtherStageLayer
from deltaspec.parallel.pipeline import stage_layers
from tests.parallel.test_tensor_parallel import (
    LOGPROBS,
    OPTIONS,
    PROMPTS,
    _children,
    assert_same_outputs,
    torchrun,
)
from tests.tiny_models import add_mtp_weights

DOC = [(13 * i + 5) % 480 + 3 for i in range(300)]  # long enough to leave prefix checkpoints
FOLLOW = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def with_mtp(checkpoints, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pp") / "with_mtp"
    shutil.copytree(checkpoints["qwen3_5_r2"], path)  # layers: attention, GDN | GDN, attention
    add_mtp_weights(path, seed=5)
    return path


def session(path: Path, **options) -> tuple[list, list]:
    """Three prompts at once (so a pass splits into micro-batches), then a document and its follow-up, which resumes
    from the document's prefix checkpoint: (the outputs of the three, those of the document and the follow-up)."""
    llm = LLM(str(path), prefix_checkpoint_min_prompt=128, **(OPTIONS | options))
    try:
        batch = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], LOGPROBS)
        first = llm.generate([{"prompt_token_ids": DOC}], FOLLOW)[0]
        follow_up = DOC + first.outputs[0].token_ids + [11, 12, 13]
        resumed = llm.generate([{"prompt_token_ids": follow_up}], FOLLOW)[0]
        if options.get("pipeline_parallel_size", 1) > 1:  # rank 0 is stage 0: layers 0-1, and their caches only
            layers = llm.engine.model.model.layers
            assert [isinstance(layer, OtherStageLayer) for layer in layers] == [False, False, True, True]
            assert len(llm.engine.cache.gdn.state) == 1 and llm.engine.model.held_attention_layers == 1
    finally:
        llm.close()
    assert resumed.num_cached_tokens == len(DOC) + len(first.outputs[0].token_ids) - 1
    return batch, [first, resumed]


def test_stages_give_the_logprobs_of_one_process_with_speculation_and_prefix_caching(with_mtp):
    """MTP drafts (a random head's: rejected, so every stage rolls its own layers back) on 2 stages, and a draft model
    (the target itself: accepted) on 2 stages x 2 tensor-parallel ranks; steps of several sequences cut into 2
    micro-batches."""
    mtp = dict(speculative="mtp", draft_tokens=3)
    want = session(with_mtp, **mtp)
    got = session(with_mtp, pipeline_parallel_size=2, pipeline_micro_batches=2, **mtp)
    for a, b in zip(got, want, strict=True):
        assert_same_outputs(a, b)
    drafted = sum(sum(o.metrics["drafted_at"]) for o in got[0])
    assert drafted > sum(o.metrics["spec_accepted_tokens"] for o in got[0])  # rejected drafts rolled back
    draft = dict(speculative="draft", draft_model=str(with_mtp), draft_tokens=3)
    got = session(with_mtp, pipeline_parallel_size=2, tensor_parallel_size=2, pipeline_micro_batches=2, **draft)
    for a, b in zip(got, want, strict=True):
        assert_same_outputs(a, b)
    assert sum(o.metrics["spec_accepted_tokens"] for o in got[0]) > 0  # accepted drafts folded into every stage


def test_ranks_torchrun_starts_form_stages_and_only_rank_0_runs_the_command(checkpoints, tmp_path, capsys):
    """torchrun's env:// rendezvous with two stages: rank 0 prints what one process prints."""
    from deltaspec.cli import main
    from tests.tiny_tokenizer import write_tiny_tokenizer

    path = tmp_path / "model"
    shutil.copytree(checkpoints["qwen3_5_r2"], path)
    write_tiny_tokenizer(path)
    argv = ["generate", "--model", str(path), "--device", "cpu", "--dtype", "float64", "--max-model-len", "256"]
    argv += ["--max-tokens", "10", "--temperature", "0", "--ignore-eos", "--speculative", "ngram", "def add(a, b):"]
    assert main(argv) == 0
    single = capsys.readouterr().out
    out = torchrun(tmp_path, *argv, "--pipeline-parallel-size", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == single and single.startswith("def add(a, b):")


def test_sizes_that_cannot_work_are_one_sentence(checkpoints, monkeypatch):
    path = str(checkpoints["qwen3_5_r2"])
    with pytest.raises(DeltaspecError, match=r"more stages than the model has layers \(4\); give at most 4\.$"):
        LLM(path, pipeline_parallel_size=5, **OPTIONS)
    with pytest.raises(DeltaspecError, match="block drafter reads the outputs of layers on every pipeline stage"):
        LLM(path, pipeline_parallel_size=2, speculative="block", **OPTIONS)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    with pytest.raises(DeltaspecError, match=r"--pipeline-parallel-size 2 x --tensor-parallel-size 2 makes 4 ranks"):
        LLM(path, pipeline_parallel_size=2, tensor_parallel_size=2, **OPTIONS)


def test_layers_split_as_vllm_splits_them_and_the_plan_is_one_stage():
    assert [stage_layers(5, 2, s) for s in range(2)] == [range(0, 3), range(3, 5)]
    assert [len(stage_layers(64, 3, s)) for s in range(3)] == [21, 22, 21]  # the extra layer before the last stage
    assert [stage_layers(4, 4, s) for s in range(4)] == [range(i, i + 1) for i in range(4)]
    config = EngineConfig.from_flat(random_weights=True, shape="qwen3.5-0.8b", device="cpu", max_model_len=4096)
    config = config.with_settings(max_num_seqs=1)
    whole, staged = plan_for(config), plan_for(config.with_settings(pipeline_parallel_size=2))
    assert any("pipeline parallel 2 (this stage: layers 0-11 of 24" in note for note in staged.plan.notes)
    assert staged.plan.weights < 0.7 * whole.plan.weights  # half the layers; the embeddings and LM head on both


def test_a_step_splits_into_micro_batches_of_whole_sequences():
    def items(*rows):
        return [SimpleNamespace(num_rows=r) for r in rows]

    def rows(groups):
        return [[item.num_rows for item in group] for group in groups]

    assert rows(micro_batches(items(1, 1), 2)) == [[1], [1]]
    assert rows(micro_batches(items(1, 1, 10), 2)) == [[1, 1], [10]]
    assert rows(micro_batches(items(10, 1, 1), 2)) == [[10], [1, 1]]
    assert rows(micro_batches(items(4, 4, 4, 4), 2)) == [[4, 4], [4, 4]]
    assert rows(micro_batches(items(3), 2)) == [[3]]
    assert rows(micro_batches(items(1, 1, 1), 1)) == [[1, 1, 1]]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the stage's process through /proc")
def test_a_dead_stage_stops_the_server_with_a_message(checkpoints):
    command = [sys.executable, "-m", "deltaspec.cli", "serve", "--model", str(checkpoints["qwen3_5_r2"])]
    command += ["--device", "cpu", "--dtype", "float64", "--port", "0", "-pp", "2", "--max-streams", "2"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
    try:
        assert re.search(r":(\d+)/v1", server.stdout.readline())  # serving: both stages built
        cmdlines = {pid: Path(f"/proc/{pid}/cmdline").read_text() for pid in _children(server.pid)}
        (stage,) = [pid for pid, cmdline in cmdlines.items() if "deltaspec.engine.follower" in cmdline]
        os.kill(stage, signal.SIGKILL)
        started = time.monotonic()
        server.wait(timeout=30)
        assert time.monotonic() - started < 30 and server.returncode != 0
        assert "pipeline stage 1 (rank 1) exited (code -9); the engine cannot go on without it" in server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
