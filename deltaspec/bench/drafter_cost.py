"""`deltaspec bench drafter`: what one drafting round costs against a target decode step (DESIGN §6).

One sequence with `context` random prompt tokens decodes `max_tokens` tokens greedily twice on the same engine:
first without drafts (the draft length held at 0), then with the configured drafter at a fixed draft length k
(`--draft-tokens`). Every drafter call (`propose`) and every target pass is timed with the device synchronised
before and after. Per run: the median plain decode pass (1 row), the median verify pass (1 + k rows) and the
median drafter call; the report gives the medians over runs and draft_fraction = drafter call / plain step.
A random-weight shape with `--speculative block` and no `--draft-model` drafts with a random block drafter
sized for the shape (`BlockDrafterConfig.sized_for`): its cost does not depend on its weights' values.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from deltaspec.bench.device import bench_engine, identity, random_prompt, run, say, sync
from deltaspec.config.engine import EngineConfig
from deltaspec.errors import DeltaspecError
from deltaspec.spec.policy import FixedDraftLength

WARMUP_SEED = 1 << 20


def timed(call: Callable, device, record: Callable[[tuple, float], None]) -> Callable:
    """`call` wrapped to hand `record` its arguments and its wall time in ms, the device synchronised around it."""

    def wrapper(*args):
        sync(device)
        begin = time.perf_counter()
        out = call(*args)
        sync(device)
        record(args, 1000 * (time.perf_counter() - begin))
        return out

    return wrapper


def bench_drafter(config: EngineConfig, context: int, max_tokens: int, runs: int) -> dict:
    if config.speculation.speculative == "none":
        raise DeltaspecError("bench drafter times a drafter: give --speculative (e.g. block, mtp or draft).")
    k = config.speculation.draft_tokens
    if max_tokens < 2 * (k + 1):
        raise DeltaspecError(
            f"bench drafter needs --max-tokens of at least {2 * (k + 1)} for drafts of {k} tokens (two full rounds)."
        )
    engine = bench_engine(config, context + max_tokens + k + 1, draft_policy=FixedDraftLength(k))
    speculator, device = engine.speculator, engine.device
    passes: dict[int, list[float]] = {}  # rows of the pass -> ms
    proposals: list[float] = []
    engine.runner.execute = timed(
        engine.runner.execute,
        device,
        lambda args, ms: passes.setdefault(sum(item.num_rows for item in args[0]), []).append(ms),
    )
    speculator.drafter.propose = timed(speculator.drafter.propose, device, lambda args, ms: proposals.append(ms))
    per_run = []
    for i in range(runs + 1):  # the first run warms up (kernel compilation, allocator)
        prompt = random_prompt(engine, context, WARMUP_SEED if i == 0 else i)
        passes.clear()
        proposals.clear()
        speculator.policy = FixedDraftLength(0)
        run(engine, [prompt], max_tokens)
        plain = statistics.median(passes.get(1, [float("nan")]))
        passes.clear()
        speculator.policy = FixedDraftLength(k)
        run(engine, [prompt], max_tokens)
        if not proposals or 1 + k not in passes:
            raise DeltaspecError(f"The {speculator.name} drafter proposed no {k}-token draft to time.")
        if i:
            per_run.append(
                {
                    "plain_step_ms": plain,
                    "verify_pass_ms": statistics.median(passes[1 + k]),
                    "propose_ms": statistics.median(proposals),
                    "proposals": len(proposals),
                }
            )
            say(f"run {i}: plain step {plain:.2f} ms, drafter call {per_run[-1]['propose_ms']:.2f} ms")
    medians = {key: statistics.median(r[key] for r in per_run) for key in ("plain_step_ms", "verify_pass_ms")}
    propose = statistics.median(r["propose_ms"] for r in per_run)
    return {
        **identity(engine, "drafter", context=context, max_tokens=max_tokens, runs=runs),
        **medians,
        "propose_ms": propose,
        "draft_fraction_of_step": propose / medians["plain_step_ms"],
        "verify_ratio": medians["verify_pass_ms"] / medians["plain_step_ms"],
        "per_run": per_run,
    }
