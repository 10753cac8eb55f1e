"""`deltaspec bench spec`: plain decoding against each drafter and draft length (chains, and trees of drafts with
`--trees`), one stream at a time.

For every configuration the fixed prompt set (code completions and chat requests) runs one
request at a time (single-stream speed), `runs` times. Reported per configuration: decode tok/s
by DESIGN §6 ((n_new - 1) / (t_total - t_first), median over requests, then over runs), AL =
accepted draft tokens / verify rounds, tokens per round (AL + 1), acceptance per draft position,
and the speed-up over plain decoding.
"""

from __future__ import annotations

import statistics

from deltaspec.bench.prompts import CHAT, CODE
from deltaspec.config.engine import EngineConfig
from deltaspec.llm import LLM
from deltaspec.sample.params import SamplingParams


def prompt_set(llm: LLM) -> list[str]:
    chats = (
        [llm.tokenizer.apply_chat_template([{"role": "user", "content": c}], enable_thinking=False) for c in CHAT]
        if llm.tokenizer is not None and llm.tokenizer.has_chat_template
        else []
    )
    return CODE + chats


def measure(engine_config: EngineConfig, max_tokens: int, runs: int, progress=print) -> dict:
    llm = LLM(**engine_config.flat())
    prompts = prompt_set(llm)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[0], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    per_run = []
    for _ in range(runs):
        outs = [llm.generate(p, params)[0] for p in prompts]
        rounds = sum(o.metrics.get("spec_rounds", 0) for o in outs)
        accepted = sum(o.metrics.get("spec_accepted_tokens", 0) for o in outs)
        drafted_at, accepted_at = [], []
        for o in outs:
            for i, (a, d) in enumerate(zip(o.metrics.get("accepted_at", []), o.metrics.get("drafted_at", []))):
                if i == len(drafted_at):
                    drafted_at.append(0)
                    accepted_at.append(0)
                drafted_at[i] += d
                accepted_at[i] += a
        per_run.append(
            {
                "decode_tok_s": statistics.median(o.metrics["decode_tok_s"] for o in outs),
                "acceptance_length": accepted / rounds if rounds else None,
                "acceptance_per_position": [a / d for a, d in zip(accepted_at, drafted_at)],
            }
        )
    drafting = engine_config.speculation.speculative != "none"
    row = {
        "speculative": engine_config.speculation.speculative,
        "draft_tokens": engine_config.speculation.draft_tokens if drafting else 0,
        "speculative_tree": engine_config.speculation.speculative_tree if drafting else 0,
        "verify_rows": (engine_config.speculation.speculative_tree or engine_config.speculation.draft_tokens + 1)
        if drafting
        else 1,
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in per_run),
        "acceptance_length": per_run[0]["acceptance_length"],
        "tokens_per_round": per_run[0]["acceptance_length"] + 1 if per_run[0]["acceptance_length"] else 1.0,
        "acceptance_per_position": per_run[0]["acceptance_per_position"],
        "runs": per_run,
        "device": llm.engine.config.host.device,
        "dtype": llm.engine.config.load.dtype,
        "prompts": len(prompts),
    }
    al = f"{row['acceptance_length']:.2f}" if row["acceptance_length"] is not None else "n/a"
    shape = f"tree={row['speculative_tree']:<2}" if row["speculative_tree"] else f"k={row['draft_tokens']:<2}"
    progress(f"{row['speculative']:>12} {shape} decode {row['decode_tok_s']:.1f} tok/s, AL {al}")
    return row
