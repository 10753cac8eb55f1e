"""`deltaspec bench longctx`: a follow-up question about a long document (issue #7, DESIGN §4).

Per run, a fresh document of `doc_tokens` random token ids and a first question of `question_tokens`
random ids: request 1 = doc + q1 generates `max_tokens` tokens greedily (eos ignored), giving the
first-question TTFT and decode tok/s. When it has finished, request 2 = doc + q1 + answer 1 + q2 (a second
random question) gives the follow-up TTFT, how many of its prompt tokens came from the prefix cache
(`num_cached_tokens`) and its decode tok/s at that depth, (n_new - 1) / (t_total - t_first_token) by
DESIGN §6. A full-size warm-up run precedes the timed ones; the report gives medians over runs and the
per-run values, with the engine's prefix-caching setting.
"""

from __future__ import annotations

import statistics

from deltaspec.bench.decode import WARMUP_SEED
from deltaspec.bench.device import bench_engine, identity, random_prompt, run, say
from deltaspec.config.engine import EngineConfig
from deltaspec.engine.engine import Engine
from deltaspec.engine.planning import plan_for
from deltaspec.errors import DeltaspecError

MEDIANS = (
    "first_ttft_s",
    "first_decode_tok_s",
    "follow_up_ttft_s",
    "follow_up_num_cached_tokens",
    "follow_up_decode_tok_s",
)


def check_sizes(config: EngineConfig, doc_tokens: int, question_tokens: int, max_tokens: int, runs: int) -> int:
    """The positions a run needs (document, two questions, two answers); an error when they do not fit."""
    if min(doc_tokens, question_tokens, runs) < 1 or max_tokens < 2:
        raise DeltaspecError(
            "--doc-tokens, --question-tokens and --runs must be at least 1 and --max-tokens at "
            "least 2 (decode tok/s needs two new tokens)."
        )
    longest = doc_tokens + 2 * question_tokens + 2 * max_tokens
    limit = plan_for(
        config.with_settings(max_model_len=longest, allow_long_max_model_len=True)
    ).model_config.max_position_embeddings
    if longest > limit:
        raise DeltaspecError(
            f"A document of {doc_tokens} tokens with two questions and two answers needs {longest} "
            f"positions, more than the model's {limit}; use a smaller --doc-tokens."
        )
    return longest


def longctx_run(engine: Engine, doc_tokens: int, question_tokens: int, max_tokens: int, seed: int) -> dict:
    """Request 1 (doc + q1), then the follow-up (doc + q1 + answer 1 + q2) once it has finished."""
    doc = random_prompt(engine, doc_tokens, 3 * seed)
    q1, q2 = (random_prompt(engine, question_tokens, 3 * seed + k) for k in (1, 2))
    first = run(engine, [doc + q1], max_tokens)[0]
    follow_up = run(engine, [doc + q1 + first.output_ids + q2], max_tokens)[0]
    m1, m2 = first.metrics(), follow_up.metrics()
    return {
        "first_ttft_s": m1["time_to_first_token"],
        "first_decode_tok_s": m1["decode_tok_s"],
        "follow_up_ttft_s": m2["time_to_first_token"],
        "follow_up_num_cached_tokens": follow_up.cache.num_cached_tokens,
        "follow_up_prompt_tokens": len(follow_up.request.prompt_ids),
        "follow_up_decode_tok_s": m2["decode_tok_s"],
    }


def bench_longctx(config: EngineConfig, doc_tokens: int, question_tokens: int, max_tokens: int, runs: int) -> dict:
    engine = bench_engine(config, check_sizes(config, doc_tokens, question_tokens, max_tokens, runs))
    say(f"warm-up: a {doc_tokens}-token document and a follow-up ...")
    longctx_run(engine, doc_tokens, question_tokens, max_tokens, WARMUP_SEED)
    per_run = []
    for i in range(runs):
        per_run.append(r := longctx_run(engine, doc_tokens, question_tokens, max_tokens, seed=i))
        say(
            f"run {i + 1}/{runs}: first-question TTFT {r['first_ttft_s']:.3f} s, follow-up TTFT "
            f"{r['follow_up_ttft_s']:.3f} s ({r['follow_up_num_cached_tokens']} of {r['follow_up_prompt_tokens']} "
            f"tokens cached), decode {r['first_decode_tok_s']:.2f} / {r['follow_up_decode_tok_s']:.2f} tok/s"
        )
    cfg = engine.config
    return identity(
        engine,
        "longctx",
        doc_tokens=doc_tokens,
        question_tokens=question_tokens,
        max_tokens=max_tokens,
        runs=runs,
        prefix_caching=cfg.cache.enable_prefix_caching,
        prefix_checkpoint_min_prompt=cfg.cache.prefix_checkpoint_min_prompt,
        max_model_len=cfg.scheduler.max_model_len,
        follow_up_prompt_tokens=per_run[0]["follow_up_prompt_tokens"],
        **{key: statistics.median(r[key] for r in per_run) for key in MEDIANS},
        per_run=per_run,
    )
