"""`deltaspec bench structured`: what structured output costs per decode step (DESIGN §6).

For each stream count C (`--concurrency`), C requests with `context` random prompt tokens decode `max_tokens`
tokens greedily, first unconstrained, then constrained, on the same engine (with the engine's drafter, if any);
both with `min_tokens = max_tokens`, so no end-of-sequence token is ever picked (a constraint allows one wherever
its output may end) and both take the sampler path. The constraint (`--constraint`) keeps every step inside it
without ever ending it: `text` is the regex `[a-z ]+`, `json` a stream of JSON objects, one per line, each valid
against a small schema (JSON-state masks on every token). Reported per C: aggregate decode tok/s both ways (total
new tokens / wall time), the step time both ways (wall time / engine steps), the host time spent in the
constraint per step — computing masks (next position, along drafts, cutting drafts, in the drafter), applying
them to the logits, advancing the matchers — measured by timing those calls, and, with a drafter, the acceptance
length both ways (a constraint changes what is drafted and accepted, so the speeds differ for that reason too).
Medians over `runs` after a warm-up run.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import contextmanager

from deltaspec.bench.device import bench_engine, identity, random_prompt, say, sync
from deltaspec.config.engine import EngineConfig
from deltaspec.sample.params import SamplingParams, StructuredOutputsParams

ITEM = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 40}, "n": {"type": "integer"}}}
CONSTRAINTS = {  # neither can end: every step of the run is constrained
    "text": StructuredOutputsParams(regex=r"[a-z ]+"),
    "json": StructuredOutputsParams(grammar=f'start: item+\nitem: %json {json.dumps(ITEM)} "\\n"'),
}
TIMED = ("next_mask", "draft_masks", "valid_prefix", "advance")  # the GrammarState calls that are timed


@contextmanager
def constraint_timer(device):
    """Accumulate the wall time of every constraint call (the GrammarState methods and apply_bitmask) in the
    yielded list, the device synchronised before apply_bitmask returns."""
    import deltaspec.engine.next_tokens as next_tokens
    import deltaspec.sample.structured as structured
    import deltaspec.spec.speculator as speculator

    spent = [0.0]
    saved = {name: getattr(structured.GrammarState, name) for name in TIMED}
    apply = structured.apply_bitmask

    def timed(fn, synchronise=False):
        def wrapper(*args, **kwargs):
            begin = time.perf_counter()
            out = fn(*args, **kwargs)
            if synchronise:
                sync(device)
            spent[0] += time.perf_counter() - begin
            return out

        return wrapper

    for name, fn in saved.items():
        setattr(structured.GrammarState, name, timed(fn))
    next_tokens.apply_bitmask = speculator.apply_bitmask = timed(apply, synchronise=True)
    try:
        yield spent
    finally:
        for name, fn in saved.items():
            setattr(structured.GrammarState, name, fn)
        next_tokens.apply_bitmask = speculator.apply_bitmask = apply


def _run(engine, prompts: list[list[int]], max_tokens: int, spec: StructuredOutputsParams | None) -> tuple:
    """(new tokens, seconds, engine steps, acceptance length or None) of greedy requests for `prompts` run
    together."""
    params = SamplingParams(
        max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True, structured_outputs=spec
    )
    seqs = [
        engine.add_request(f"structured-{i}-{time.perf_counter_ns()}", None, p, params) for i, p in enumerate(prompts)
    ]
    sync(engine.device)
    begin, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    sync(engine.device)
    rounds = sum(s.stats.acceptance.rounds for s in seqs)
    accepted = sum(s.stats.acceptance.accepted for s in seqs) / rounds if rounds else None
    return sum(len(s.output_ids) for s in seqs), time.perf_counter() - begin, steps, accepted


def bench_structured(
    config: EngineConfig, concurrency: list[int], context: int, max_tokens: int, runs: int, constraint: str
) -> dict:
    spec = CONSTRAINTS[constraint]
    engine = bench_engine(config, context + max_tokens + config.speculation.draft_tokens + 1, max(concurrency))
    rows = []
    for streams in concurrency:
        per_run = []
        for i in range(runs + 1):  # the first run warms up
            prompts = [random_prompt(engine, context, 1000 * i + s) for s in range(streams)]
            plain = _run(engine, prompts, max_tokens, None)
            with constraint_timer(engine.device) as spent:
                constrained = _run(engine, prompts, max_tokens, spec)
            if i:
                per_run.append(
                    {
                        "plain_tok_s": plain[0] / plain[1],
                        "constrained_tok_s": constrained[0] / constrained[1],
                        "plain_step_ms": 1000 * plain[1] / plain[2],
                        "constrained_step_ms": 1000 * constrained[1] / constrained[2],
                        "constraint_ms_per_step": 1000 * spent[0] / constrained[2],
                        "plain_acceptance_length": plain[3],
                        "constrained_acceptance_length": constrained[3],
                    }
                )
        row = {
            key: None if per_run[0][key] is None else statistics.median(r[key] for r in per_run) for key in per_run[0]
        }
        row["slowdown"] = row["plain_tok_s"] / row["constrained_tok_s"]
        rows.append({"streams": streams, **row})
        say(
            f"C={streams}: {row['plain_tok_s']:.1f} -> {row['constrained_tok_s']:.1f} tok/s, constraint "
            f"{row['constraint_ms_per_step']:.2f} ms of a {row['constrained_step_ms']:.2f} ms step"
        )
    return {
        **identity(engine, "structured", context=context, max_tokens=max_tokens, runs=runs, constraint=constraint),
        "rows": rows,
    }
