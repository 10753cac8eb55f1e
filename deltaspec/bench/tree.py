"""`deltaspec bench tree-oracle`: a tree of drafts against a chain of as many verify rows, with an oracle drafter
at a known per-rank acceptance profile (`deltaspec.spec.oracle`), single stream.

One engine grows trees of at most `rows` rows (`--speculative-tree rows`). Per run and prompt, `spec_run` decodes
plainly, then with the oracle as a chain of `rows - 1` drafts whose every position is right with probability
ranks[0], then as a tree grown from `len(ranks)` candidates per position at the profile `ranks` (the same first
ranks, so the chain is the tree's first branch). The target agrees with the oracle's reference
(`deltaspec.bench.decode.agreeing`), so both shapes draft every round at their profiles, however their passes round.
Every step whose oracle drafted the full depth verified `rows` rows in both shapes; its time (the whole step:
drafting, growing, the pass, verification, rollback) is timed on its own, and the median over those steps and runs
is the pass cost compared.

Reported: per shape the measured decode tok/s, measured AL and expected AL (the chain's from its profile, the
tree's the sum of its nodes' path probabilities), the median verify step, the round rate (AL + 1) / verify step
(what the decode speed would be if every step were a full-depth round: the measured rate falls below it by the
rounds near the end that draft less and by whatever a step spends outside the timed ones), the tree's measured
decode speed and step against the chain's, and what the tree costs in memory: the pass's tree tensors
(`TreeRows`: parents, ancestor masks, recurrence hints, fold rows), the recurrence's extra row steps (a row that
restarts replays its ancestors from the folded state), and per sequence the one GDN state plus the log, against
the per-node state copies a snapshot design keeps.
"""

from __future__ import annotations

import statistics

from deltaspec.bench.decode import WARMUP_SEED, oracle_engine, spec_run
from deltaspec.bench.device import identity, random_prompt, say
from deltaspec.config.engine import EngineConfig
from deltaspec.engine.engine import Engine
from deltaspec.errors import DeltaspecError
from deltaspec.ops.layout import TREE_RESTART, ancestor_masks, recurrence_flags
from deltaspec.spec.drafter import Draft
from deltaspec.spec.oracle import expected_acceptance_length
from deltaspec.spec.tree import DraftTree, TreeStats, grow_tree


def expected_tree(ranks: list[float], rows: int) -> DraftTree:
    """The tree the dynamic shape grows from the oracle's candidates: at most `rows - 1` nodes, as deep."""
    depth = rows - 1
    draft = Draft(list(range(depth)), candidates=[list(zip(range(len(ranks)), ranks))] * depth)
    return grow_tree(draft, depth, TreeStats(), static=False, costs=None)


def tree_memory(engine: Engine, tree: DraftTree) -> dict:
    """What a tree of `tree`'s shape costs beyond a chain's pass, and per sequence (see the module docstring)."""
    parents = [-1, *tree.parents]
    rows, log_rows = len(parents), engine.plan.cache.log_rows
    flags, masks = recurrence_flags(parents), ancestor_masks(parents)
    replayed = sum(bin(m & ((1 << 64) - 1)).count("1") - 1 for m, f in zip(masks, flags) if f & TREE_RESTART)
    gdn = engine.cache.gdn
    state = sum(t[0].numel() * t.element_size() for t in (*gdn.state, *gdn.conv))
    logs = [t for log in gdn.log if log is not None for t in (log.k, log.v, log.g, log.beta)]
    log_bytes = sum(t[0].numel() * t.element_size() for t in (*logs, *(c for c in gdn.conv_log if c is not None)))
    return {
        "tree_tensors_bytes_per_pass": rows * (4 + 8 + 4) + log_rows * 4,  # int32 parent, int64 mask, int32 hint
        "recurrence_restarts": sum(bool(f & TREE_RESTART) for f in flags),
        "recurrence_replayed_rows": replayed,
        "state_bytes_per_sequence": state,
        "log_bytes_per_sequence": log_bytes,
        "per_node_snapshot_bytes_per_sequence": (rows - 1) * state,
    }


def bench_tree_oracle(
    config: EngineConfig, ranks: list[float], rows: int, context: int, max_tokens: int, runs: int
) -> dict:
    if rows < 2:
        raise DeltaspecError(f"A tree needs at least 2 verify rows; got --rows {rows}.")
    if max_tokens < 2 * rows:
        raise DeltaspecError(f"--max-tokens {max_tokens} leaves no room for full-depth drafts; use {4 * rows} or more.")
    k = rows - 1
    engine, oracle = oracle_engine(config, context + max_tokens, k, tree=rows)
    chain_profile = [ranks[0]] * k
    warm = random_prompt(engine, context, WARMUP_SEED)
    for shape in (None, ranks):  # graphs, kernels and the trees' statistics
        spec_run(engine, oracle, chain_profile, warm, min(max_tokens, 4 * rows), ranks=shape)
    per_run = []
    for i in range(runs):
        prompt = random_prompt(engine, context, i)
        chain = spec_run(engine, oracle, chain_profile, prompt, max_tokens)
        tree = spec_run(engine, oracle, chain_profile, prompt, max_tokens, ranks=ranks)
        per_run.append({"chain": chain, "tree": tree})
        say(
            f"run {i + 1}/{runs}: plain {chain['plain_decode_tok_s']:.2f} tok/s; chain AL "
            f"{chain['acceptance_length']:.2f}, {chain['spec_decode_tok_s']:.2f} tok/s, step "
            f"{chain['verify_step_ms']:.2f} ms; tree AL {tree['acceptance_length']:.2f}, "
            f"{tree['spec_decode_tok_s']:.2f} tok/s, step {tree['verify_step_ms']:.2f} ms"
        )

    def median(shape: str, key: str) -> float:
        values = [r[shape][key] for r in per_run if r[shape][key] is not None]
        if not values:
            raise DeltaspecError(f"No {shape} step drafted the full depth; raise --max-tokens.")
        return statistics.median(values)

    def shape_report(shape: str, expected: float) -> dict:
        al, step = median(shape, "acceptance_length"), median(shape, "verify_step_ms")
        return {
            "expected_acceptance_length": expected,
            "acceptance_length": al,
            "decode_tok_s": median(shape, "spec_decode_tok_s"),
            "verify_step_ms": step,
            "round_rate_tok_s": 1000 * (al + 1) / step,
        }

    grown = expected_tree(ranks, rows)
    plain = statistics.median(r[s]["plain_decode_tok_s"] for r in per_run for s in ("chain", "tree"))
    chain_step, tree_step = median("chain", "verify_step_ms"), median("tree", "verify_step_ms")
    return identity(
        engine,
        "tree-oracle",
        context=context,
        max_tokens=max_tokens,
        runs=runs,
        speculative=f"oracle tree of {rows} rows against a chain of {rows} rows",
        verify_rows=rows,
        ranks=ranks,
        tree_parents=[-1, *grown.parents],
        plain_decode_tok_s=plain,
        chain=(chain := shape_report("chain", expected_acceptance_length(chain_profile))),
        tree=(tree := shape_report("tree", sum(grown.values))),
        tree_step_over_chain_step=tree_step / chain_step,
        tree_speedup_over_chain=tree["decode_tok_s"] / chain["decode_tok_s"],
        tree_round_rate_over_chain=tree["round_rate_tok_s"] / chain["round_rate_tok_s"],
        workspace=tree_memory(engine, grown),
        per_run=per_run,
    )
