"""tools/train_block.py trains a block drafter on the CPU at tiny sizes: on a learnable stream its loss falls and
its held-out drafts become right far above chance, it writes a DFlash-layout drafter the engine loads, and
speculative greedy with it stays exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from deltaspec import LLM, SamplingParams
from tests.tiny_models import write_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def test_training_a_block_drafter_learns_and_loads(tmp_path):
    target = write_checkpoint(tmp_path / "target", "qwen3_5", seed=0)
    pack = tmp_path / "pack"
    pack.mkdir()
    rng = np.random.default_rng(0)
    phrases = [rng.integers(0, 500, size=12) for _ in range(8)]  # a stream of recurring phrases: learnable
    stream = np.concatenate([phrases[i] for i in rng.integers(0, len(phrases), size=2000)]).astype("<u2")
    for name in ("train", "heldout_code", "heldout_chat"):
        stream.tofile(pack / f"{name}.bin")
    out = tmp_path / "block"
    command = [sys.executable, str(ROOT / "tools" / "train_block.py"), "--target", str(target), "--out", str(out)]
    command += ["--pack", str(pack), "--device", "cpu", "--layers", "1", "--block-size", "4", "--seq-len", "64"]
    command += ["--batch", "2", "--anchors", "8", "--tokens", str(2 * 64 * 150), "--lr", "1e-2", "--warmup", "5"]
    command += ["--eval-stride", "16"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT / "tools", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    curve = json.loads((out / "training_curve.json").read_text())
    final = curve["final"]["code"]
    assert curve["train_loss"][-1] < curve["train_loss"][0]
    assert len(final["top1_per_position"]) == 3  # a block of 4 drafts 3 tokens
    # chance is 1 in 500; the recurring phrases make the next tokens predictable from the target's features
    assert final["top1_per_position"][0] > 0.2 and 0.3 < final["acceptance_length"] <= 3

    prompts = [{"prompt_token_ids": [int(t) for t in stream[a:b]]} for a, b in ((0, 30), (7, 40))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(str(target), dtype="float64", device="cpu").generate(prompts, params)
    spec = LLM(
        str(target), dtype="float64", device="cpu", speculative="block", draft_tokens=3, draft_model=str(out)
    ).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.get("spec_rounds", 0) for o in spec) > 0
