"""`deltaspec bench decode` and `deltaspec bench spec-oracle`: single-stream decode speed (DESIGN §6).

decode: one sequence with `context` random prompt tokens generates `max_tokens` tokens greedily (eos
ignored), `runs` times after a warm-up; decode tok/s = (n_new - 1) / (t_total - t_first_token), median
over runs; step_ms = 1000 / decode tok/s. Bytes per step (for MoE, the distinct experts per layer that an
untimed run's steps read), measured copy bandwidth, the roofline and the fraction of it come from
`deltaspec.bench.roofline`; the roofline at the device's fixed reference bandwidth and its fraction, from
`deltaspec.bench.reference`; `--compare-hf` adds transformers' speed on the same
weights (`deltaspec.bench.hf_compare`).

spec-oracle: per run, a plain greedy decode of the prompt (timed), whose output is the oracle's reference; then the
same prompt decodes speculatively with the oracle drafter (`deltaspec.spec.oracle`) at a fixed draft length and the
given acceptance profile, timing the whole propose / verify / rollback / commit path. The oracle engine's target
agrees with the reference (`agreeing`), so no pass's rounding moves the run off it. Reported: plain and speculative
decode tok/s, the speed-up, measured AL against the profile's expected AL.
"""

from __future__ import annotations

import statistics
import time

from deltaspec.bench.device import (
    bench_engine,
    copy_bandwidth,
    device_name,
    identity,
    random_prompt,
    run,
    say,
    start,
)
from deltaspec.bench.reference import reference_for, reference_roofline
from deltaspec.bench.roofline import bytes_per_step, experts_per_step, roofline
from deltaspec.config.engine import EngineConfig
from deltaspec.engine.engine import Engine
from deltaspec.engine.planning import plan_for
from deltaspec.errors import DeltaspecError
from deltaspec.execution.runner import Scheduled, SeqOutput
from deltaspec.execution.sequence import Sequence
from deltaspec.spec.oracle import OracleDrafter, expected_acceptance_length
from deltaspec.spec.policy import FixedDraftLength

WARMUP_SEED = 1 << 20


def decode_run(engine: Engine, context: int, max_tokens: int, seed: int) -> dict:
    seq = run(engine, [random_prompt(engine, context, seed)], max_tokens)[0]
    m = seq.metrics()
    return {"decode_tok_s": m["decode_tok_s"], "ttft_s": m["time_to_first_token"], "new_tokens": len(seq.output_ids)}


def bench_decode(config: EngineConfig, context: int, max_tokens: int, runs: int, compare_hf: bool = False) -> dict:
    if compare_hf and config.parallel.world_size > 1:
        raise DeltaspecError("--compare-hf runs transformers on one device; drop the parallel sizes.")
    engine = bench_engine(config, context + max_tokens)
    mtp = "mtp" in engine.config.speculation.speculative.split("+")
    say("measuring copy bandwidth ...")
    bandwidth = copy_bandwidth(engine.device)
    decode_run(engine, context, min(max_tokens, 4), WARMUP_SEED)
    per_run = []
    for i in range(runs):
        per_run.append(decode_run(engine, context, max_tokens, seed=i))
        say(f"decode run {i + 1}/{runs}: {per_run[-1]['decode_tok_s']:.2f} tok/s")
    tok_s = statistics.median(r["decode_tok_s"] for r in per_run)
    experts = experts_per_step(engine, [random_prompt(engine, context, seed=runs)], max_tokens)
    step_bytes = bytes_per_step(engine, context + max_tokens / 2, mtp, experts=experts)
    reference = reference_for(device_name(engine.device))
    report = identity(
        engine,
        "decode",
        context=context,
        max_tokens=max_tokens,
        runs=runs,
        decode_tok_s=tok_s,
        step_ms=1000 / tok_s,
        **roofline(tok_s, step_bytes["total"], bandwidth, engine.config.speculation.speculative == "none"),
        reference_bandwidth=reference,
        **reference_roofline(tok_s, step_bytes["total"], reference),
        bytes_per_step_parts=step_bytes,
        moe_experts_per_step=experts,
        kv_context_mean=context + max_tokens / 2,
        per_run=per_run,
    )
    if report["roofline_violation"]:
        say("WARNING: decode is faster than the bandwidth roofline -- the bytes-per-step count or the timing is wrong")
    if compare_hf:
        from deltaspec.bench.hf_compare import hf_decode

        hf = hf_decode(engine, context, max_tokens, runs)
        report.update(hf, speedup_vs_hf=tok_s / hf["hf_decode_tok_s"])
        say(f"transformers: {hf['hf_decode_tok_s']:.2f} tok/s; deltaspec is {report['speedup_vs_hf']:.2f}x")
    return report


def oracle_engine(
    config: EngineConfig, longest: int, draft_tokens: int, streams: int = 1, tree: int = 0
) -> tuple[Engine, OracleDrafter]:
    """An engine drafting with an oracle whose target agrees with it (`agreeing`): replay logs for `draft_tokens`
    drafts, and every round as long a draft as the sequence's expectation allows (trees of at most `tree` rows,
    each as large as the oracle's candidates allow); sequences the oracle expects nothing of decode plainly."""
    k = max(draft_tokens, 1)
    oracle = OracleDrafter(plan_for(config).model_config.vocab_size, config.scheduler.seed)
    engine = bench_engine(
        config.with_settings(draft_tokens=k, speculative_tree=tree),
        longest,
        streams,
        drafter=oracle,
        draft_policy=FixedDraftLength(k),
    )
    engine.runner.execute = agreeing(engine.runner.execute, oracle)
    return engine, oracle


def predicted_positions(out: SeqOutput) -> list[int]:
    """Per token row of `out` (the rows its argmax covers), the position of the token the row predicts: one past
    the row's own position (a tree's rows sit at their depths), read before the engine advances the sequence."""
    if not out.verifying:
        return [out.first_position + out.rows] * len(out.argmax)
    return [position + 1 for position in out.seq.row_positions(out.rows)]


def agreeing(execute, oracle: OracleDrafter):
    """`execute` (a runner's) with the target agreeing with `oracle`: each pass runs as it is, then the argmax of
    the token rows of the sequences the oracle drafts for is the reference's (`OracleDrafter.agree`)."""

    def execute_agreeing(schedule: list[Scheduled]) -> list[SeqOutput]:
        outputs = execute(schedule)
        for out in outputs:
            out.argmax = oracle.agree(out.seq.request.request_id, predicted_positions(out), out.argmax)
        return outputs

    return execute_agreeing


def full_draft_steps(engine: Engine, oracle: OracleDrafter, seq: Sequence, k: int) -> list[float]:
    """Step the engine until `seq` finishes; the seconds of each step in which the oracle drafted all `k` tokens
    (so the pass verified k + 1 rows, or a tree of as many)."""
    times = []
    while not seq.finished:
        proposals = len(oracle.proposed)
        t0 = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t0
        if len(oracle.proposed) > proposals and oracle.proposed[-1] == k:
            times.append(elapsed)
    if seq.finish_reason == "error":
        raise DeltaspecError(f"A benchmark request failed: {seq.error}")
    return times


def spec_run(
    engine: Engine,
    oracle: OracleDrafter,
    profile: list[float],
    prompt: list[int],
    max_tokens: int,
    ranks: list[float] | None = None,
) -> dict:
    """A plain greedy run (timed), then the prompt with the oracle drafting its output at `profile` (a tree at the
    per-rank profile `ranks`, when the engine grows trees). `verify_step_ms` is the median step that verified a
    full-length draft; `matches_plain` says that the run committed the reference."""
    plain = run(engine, [prompt], max_tokens)[0]
    seq = start(engine, [prompt], max_tokens)[0]
    oracle.expect(seq.request.request_id, len(prompt), plain.output_ids, profile, ranks=ranks)
    steps = full_draft_steps(engine, oracle, seq, len(profile))
    m, stats = seq.metrics(), seq.stats.acceptance
    return {
        "plain_decode_tok_s": plain.metrics()["decode_tok_s"],
        "spec_decode_tok_s": m["decode_tok_s"],
        "acceptance_length": stats.accepted / stats.rounds if stats.rounds else 0.0,
        "rounds": stats.rounds,
        "acceptance_per_position": m.get("acceptance_per_position", []),
        "verify_step_ms": 1000 * statistics.median(steps) if steps else None,
        "verify_steps": len(steps),
        "matches_plain": seq.output_ids == plain.output_ids,
    }


def bench_spec_oracle(config: EngineConfig, profile: list[float], context: int, max_tokens: int, runs: int) -> dict:
    k = len(profile)
    engine, oracle = oracle_engine(config, context + max_tokens, k)
    spec_run(engine, oracle, profile, random_prompt(engine, context, WARMUP_SEED), min(max_tokens, 2 * k + 2))
    per_run = []
    for i in range(runs):
        per_run.append(spec_run(engine, oracle, profile, random_prompt(engine, context, i), max_tokens))
        r = per_run[-1]
        say(
            f"run {i + 1}/{runs}: plain {r['plain_decode_tok_s']:.2f} tok/s, oracle k={k} "
            f"{r['spec_decode_tok_s']:.2f} tok/s, AL {r['acceptance_length']:.2f}"
        )
    plain = statistics.median(r["plain_decode_tok_s"] for r in per_run)
    spec = statistics.median(r["spec_decode_tok_s"] for r in per_run)
    return identity(
        engine,
        "spec-oracle",
        context=context,
        max_tokens=max_tokens,
        runs=runs,
        speculative=f"oracle k={k}",
        draft_tokens=k,
        profile=profile,
        expected_acceptance_length=expected_acceptance_length(profile),
        acceptance_length=statistics.median(r["acceptance_length"] for r in per_run),
        plain_decode_tok_s=plain,
        spec_decode_tok_s=spec,
        speedup=spec / plain,
        per_run=per_run,
    )
