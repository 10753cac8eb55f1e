"""`deltaspec bench serve|agents|data-parallel|spec|decode|verify|concurrency|prefill|longctx|spec-oracle|profile|
drafter|structured`: run a scenario and write JSON. serve and agents run against an in-process server or --url,
data-parallel against replica processes behind the front door; the device benchmarks (decode, verify, concurrency,
prefill, longctx, spec-oracle, profile, drafter, structured) drive the engine directly and never import the
server."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from deltaspec.bench.agents import bench_agents
from deltaspec.bench.client import Client, served_identity
from deltaspec.bench.plot import line_chart
from deltaspec.bench.serve import bench_serve
from deltaspec.errors import DeltaspecError
from deltaspec.provenance import commit


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextmanager
def target(args: argparse.Namespace, engine_config):
    """(client, identity, request log) for --url, checked to answer before any benchmark starts, or for a server
    started here with the engine flags."""
    if args.url:
        client = Client(args.url, args.api_key, args.served_model_name)
        yield client, {"server": client.base_url, **served_identity(client.check())}, None
        return
    from deltaspec.bench.local_server import local_server

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "requests.jsonl"
        with local_server(engine_config, log) as (url, engine):
            cfg = engine.config
            identity = {
                **(
                    {"shape": cfg.load.shape, "random_weights": True}
                    if cfg.load.random_weights
                    else {"model": str(engine.model_dir)}
                ),
                "device": str(engine.device),
                "dtype": cfg.load.dtype,
                "max_model_len": cfg.scheduler.max_model_len,
                "max_num_seqs": cfg.scheduler.max_num_seqs,
                "speculative": cfg.speculation.speculative,
                "draft_tokens": cfg.speculation.draft_tokens if cfg.speculation.speculative != "none" else None,
            }
            yield Client(url), identity, log


def write_report(report: dict, out: str | None) -> None:
    text = json.dumps(report, indent=1)
    if out:
        Path(out).write_text(text + "\n")
        say(f"wrote {out}")
    print(text)


def cmd_bench_serve(args: argparse.Namespace, engine_config) -> None:
    levels = [int(c) for c in args.concurrency.split(",")]
    with target(args, engine_config) as (client, identity, log):
        rows = bench_serve(client, levels, args.requests_per_client, args.max_tokens, args.runs, log, progress=say)
    write_report(
        {
            "benchmark": "serve",
            "commit": commit(),
            **identity,
            "max_tokens": args.max_tokens,
            "requests_per_client": args.requests_per_client,
            "runs": args.runs,
            "levels": rows,
        },
        args.out,
    )
    if args.plot:
        svg = line_chart(
            "deltaspec bench serve",
            "concurrent streams",
            "tok/s",
            levels,
            {
                "aggregate (C x 1000 / mean TPOT)": [r["aggregate_tok_s"] for r in rows],
                "output tokens / wall time": [r["output_tok_s_wall"] for r in rows],
            },
        )
        Path(args.plot).write_text(svg)
        say(f"wrote {args.plot}")


def cmd_bench_data_parallel(args: argparse.Namespace, engine_config) -> None:
    from deltaspec.bench.data_parallel import bench_data_parallel

    if args.data_parallel_size < 2:
        raise DeltaspecError(
            f"--data-parallel-size must be 2 or more to compare with one replica, got {args.data_parallel_size}."
        )
    load = engine_config.load
    result = bench_data_parallel(
        engine_config,
        args.data_parallel_size,
        args.concurrency,
        args.requests_per_client,
        args.max_tokens,
        args.runs,
        progress=say,
    )
    say(
        f"{args.data_parallel_size} replicas at C={args.data_parallel_size * args.concurrency}: "
        f"{result['aggregate_ratio']:.2f}x one replica's aggregate at C={args.concurrency}, TPOT p50 "
        f"{result['tpot_p50_ratio']:.2f}x, TTFT p50 {result['ttft_p50_ratio']:.2f}x"
    )
    write_report(
        {
            "benchmark": "data-parallel",
            "commit": commit(),
            **({"shape": load.shape, "random_weights": True} if load.random_weights else {"model": load.model}),
            "device": engine_config.host.device_name(),
            "dtype": load.dtype,
            "tensor_parallel_size": engine_config.parallel.tensor_parallel_size,
            "pipeline_parallel_size": engine_config.parallel.pipeline_parallel_size,
            "data_parallel_size": args.data_parallel_size,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "requests_per_client": args.requests_per_client,
            "runs": args.runs,
            **result,
        },
        args.out,
    )


def cmd_bench_agents(args: argparse.Namespace, engine_config) -> None:
    with target(args, engine_config) as (client, identity, _):
        identity = {**identity, **served_identity(client.check())}
        runs = [
            bench_agents(client, args.agents, args.doc_chars, args.stagger, args.max_tokens, run, progress=say)
            for run in range(args.runs)
        ]
    medians = {
        key: statistics.median(run[key][subkey] if subkey else run[key] for run in runs)
        for key, subkey in (("first_turn_wait_s", "p50"), ("follow_up_wait_s", "p50"), ("follow_up_wait_max_s", None))
    }
    write_report(
        {
            "benchmark": "agents",
            "commit": commit(),
            **identity,
            "agents": args.agents,
            "doc_chars": args.doc_chars,
            "stagger_s": args.stagger,
            "max_tokens": args.max_tokens,
            "median_over_runs": medians,
            "runs": runs,
        },
        args.out,
    )


def cmd_bench_spec(args: argparse.Namespace, engine_config) -> None:

    from deltaspec.bench.spec import measure

    configs = [engine_config.with_settings(speculative="none")]
    for drafter in args.drafters.split(","):
        configs += [engine_config.with_settings(speculative=drafter, draft_tokens=k) for k in ints(args.k)]
        configs += [  # a tree of R rows, as deep as a chain of R rows
            engine_config.with_settings(speculative=drafter, draft_tokens=rows - 1, speculative_tree=rows)
            for rows in (ints(args.trees) if args.trees else [])
        ]
    rows = [measure(config, args.max_tokens, args.runs, progress=say) for config in configs]
    plain = rows[0]["decode_tok_s"]
    for row in rows:
        row["speedup"] = row["decode_tok_s"] / plain
    write_report(
        {
            "benchmark": "spec",
            "commit": commit(),
            "model": engine_config.load.model or "embedded default",
            "max_tokens": args.max_tokens,
            "runs": args.runs,
            "configurations": rows,
        },
        args.out,
    )


def ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DeltaspecError(f"Expected comma-separated integers like 1,4,16; got {text!r}.") from None


def write_device_report(report: dict, args: argparse.Namespace, summary: str) -> None:
    """JSON on stdout with --json (and to --out), else the one-line summary."""
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
        say(f"wrote {args.out}")
    print(text if args.json else summary)


def cmd_bench_decode(args: argparse.Namespace, engine_config) -> None:
    from deltaspec.bench.decode import bench_decode

    r = bench_decode(engine_config, args.context, args.max_tokens, args.runs, args.compare_hf)
    hf = f", {r['speedup_vs_hf']:.2f}x transformers" if "speedup_vs_hf" in r else ""
    ref = r["reference_bandwidth"]
    fixed = (
        f"; at the device's reference {ref['gb_s']:.0f} GB/s: {100 * r['reference_roofline_fraction']:.1f} %"
        if ref["gb_s"]
        else "; no reference bandwidth for this device"
    )
    write_device_report(
        r,
        args,
        f"decode {r['decode_tok_s']:.2f} tok/s ({r['step_ms']:.2f} ms/step), roofline "
        f"{r['roofline_tok_s']:.2f} tok/s at the measured {r['bandwidth_gb_s']:.0f} GB/s: "
        f"{100 * r['roofline_fraction']:.1f} %{fixed}{hf}",
    )


def cmd_bench_verify(args: argparse.Namespace, engine_config) -> None:
    from deltaspec.bench.verify import bench_verify

    r = bench_verify(engine_config, args.context, ints(args.rows), args.rounds, args.runs)
    write_device_report(r, args, "; ".join(f"{row['rows']} rows {row['step_ms']:.2f} ms" for row in r["rows"]))


def cmd_bench_concurrency(args: argparse.Namespace, engine_config) -> None:
    from deltaspec.bench.concurrency import bench_concurrency

    r = bench_concurrency(engine_config, ints(args.concurrency), args.context, args.max_tokens, args.runs)
    write_device_report(
        r, args, "; ".join(f"C={row['concurrency']} {row['aggregate_tok_s']:.1f} tok/s" for row in r["levels"])
    )


def cmd_bench_prefill(args: argparse.Namespace, engine_config) -> None:
    from deltaspec.bench.prefill import bench_prefill

    r = bench_prefill(engine_config, ints(args.lengths), args.runs)
    write_device_report(
        r, args, "; ".join(f"{row['length']} tokens {row['prefill_tok_s']:.0f} tok/s" for row in r["lengths"])
    )


def cmd_bench_longctx(args: argparse.Namespace, engine_config) -> None:
    from deltaspec.bench.longctx import bench_longctx

    r = bench_longctx(engine_config, args.doc_tokens, args.question_tokens, args.max_tokens, args.runs)
    write_device_report(
        r,
        args,
        f"{r['doc_tokens']}-token document: first-question TTFT {r['first_ttft_s']:.3f} s, "
        f"follow-up TTFT {r['follow_up_ttft_s']:.3f} s ({r['follow_up_num_cached_tokens']:.0f} "
        f"of {r['follow_up_prompt_tokens']} tokens cached, prefix caching "
        f"{'on' if r['prefix_caching'] else 'off'}), follow-up decode "
        f"{r['follow_up_decode_tok_s']:.2f} tok/s",
    )


def cmd_bench_spec_oracle(args: argparse.Namespace, engine_config) -> None:
    from deltaspec.bench.decode import bench_spec_oracle
    from deltaspec.spec.oracle import parse_profile, profile_for_acceptance_length

    profile = (
        parse_profile(args.oracle_profile)
        if args.oracle_profile
        else profile_for_acceptance_length(args.oracle_al, engine_config.speculation.draft_tokens)
    )
    r = bench_spec_oracle(engine_config, profile, args.context, args.max_tokens, args.runs)
    write_device_report(
        r,
        args,
        f"plain {r['plain_decode_tok_s']:.2f} tok/s, oracle {r['spec_decode_tok_s']:.2f} "
        f"tok/s ({r['speedup']:.2f}x) at AL {r['acceptance_length']:.2f} "
        f"(profile expects {r['expected_acceptance_length']:.2f})",
    )


def cmd_bench_tree_oracle(args: argparse.Namespace, engine_config) -> None:
    from deltaspec.bench.tree import bench_tree_oracle
    from deltaspec.spec.oracle import parse_ranks

    r = bench_tree_oracle(
        engine_config, parse_ranks(args.oracle_ranks), args.rows, args.context, args.max_tokens, args.runs
    )
    chain, tree = r["chain"], r["tree"]
    write_device_report(
        r,
        args,
        f"{args.rows} rows: chain AL {chain['acceptance_length']:.2f}, {chain['decode_tok_s']:.2f} tok/s, step "
        f"{chain['verify_step_ms']:.2f} ms; tree AL {tree['acceptance_length']:.2f} (expected "
        f"{tree['expected_acceptance_length']:.2f}), {tree['decode_tok_s']:.2f} tok/s, step "
        f"{tree['verify_step_ms']:.2f} ms = {r['tree_step_over_chain_step']:.3f}x the chain's",
    )


def cmd_bench_profile(args: argparse.Namespace, engine_config) -> None:
    from deltaspec.bench.profile import bench_profile

    r = bench_profile(engine_config, args.streams, args.context, args.steps, args.top)
    lines = [
        f"{k['share'] * 100:5.1f} %  {k['us_per_step']:9.1f} us/step  {k['calls']:6d} calls  {k['name'][:90]}"
        for k in r["kernels"]
    ]
    write_device_report(
        r, args, f"{r['profiled_ms_per_step']:.2f} ms of {r['time_kind']} time per step:\n" + "\n".join(lines)
    )


def cmd_bench_drafter(args: argparse.Namespace, engine_config) -> None:
    from deltaspec.bench.drafter_cost import bench_drafter

    r = bench_drafter(engine_config, args.context, args.max_tokens, args.runs)
    write_device_report(
        r,
        args,
        f"{r['speculative']} drafter call {r['propose_ms']:.2f} ms = {100 * r['draft_fraction_of_step']:.1f} % of a "
        f"{r['plain_step_ms']:.2f} ms decode step; verify pass of {1 + r['draft_tokens']} rows "
        f"{r['verify_pass_ms']:.2f} ms ({r['verify_ratio']:.2f}x)",
    )


def cmd_bench_structured(args: argparse.Namespace, engine_config) -> None:
    from deltaspec.bench.structured_cost import bench_structured

    concurrency = [int(c) for c in args.concurrency.split(",")]
    r = bench_structured(engine_config, concurrency, args.context, args.max_tokens, args.runs, args.constraint)
    lines = [
        f"C={row['streams']}: {row['plain_tok_s']:.1f} -> {row['constrained_tok_s']:.1f} tok/s "
        f"({row['slowdown']:.2f}x), constraint {row['constraint_ms_per_step']:.2f} ms per step"
        for row in r["rows"]
    ]
    write_device_report(r, args, "\n".join(lines))


def add_device_benches(scenarios, add_engine_flags, engine_config) -> None:
    """decode, verify, concurrency, prefill, longctx, spec-oracle, tree-oracle, profile, drafter, structured: the
    engine on this device, no server."""

    def common(parser, max_tokens: int | None = 64, context: bool = True, runs: bool = True):
        if context:
            parser.add_argument("--context", type=int, default=128, help="prompt tokens (default: 128)")
        if max_tokens is not None:
            parser.add_argument(
                "--max-tokens",
                type=int,
                default=max_tokens,
                help=f"new tokens per request, eos ignored (default: {max_tokens})",
            )
        if runs:
            parser.add_argument(
                "--runs", type=int, default=3, help="repetitions; the report gives medians (default: 3)"
            )
        parser.add_argument("--json", action="store_true", help="print the JSON report (default: a summary line)")
        parser.add_argument("--out", default=None, help="also write the JSON report here")
        add_engine_flags(parser)

    decode = scenarios.add_parser("decode", help="single-stream decode tok/s, bytes per step, roofline fraction")
    decode.add_argument(
        "--compare-hf",
        action="store_true",
        help="also time transformers' generate on the same weights and report the speed-up",
    )
    common(decode)
    decode.set_defaults(func=lambda args: cmd_bench_decode(args, engine_config(args)))
    verify = scenarios.add_parser(
        "verify", help="time of one pass with r rows for one sequence, and its ratio to 1 row"
    )
    verify.add_argument("--rows", default="1,2,4,8,16,32,64", help="row counts (default: 1,2,4,8,16,32,64)")
    verify.add_argument("--rounds", type=int, default=4, help="timed passes per row count and run (default: 4)")
    common(verify, max_tokens=None)
    verify.set_defaults(func=lambda args: cmd_bench_verify(args, engine_config(args)))
    conc = scenarios.add_parser("concurrency", help="aggregate decode tok/s of C streams decoding together")
    conc.add_argument("--concurrency", default="1,4,16,32", help="stream counts (default: 1,4,16,32)")
    common(conc)
    conc.set_defaults(func=lambda args: cmd_bench_concurrency(args, engine_config(args)))
    prefill = scenarios.add_parser("prefill", help="prefill tok/s (length / time to first token) per prompt length")
    prefill.add_argument("--lengths", default="1024,8192,32768", help="prompt lengths (default: 1024,8192,32768)")
    common(prefill, max_tokens=None, context=False)
    prefill.set_defaults(func=lambda args: cmd_bench_prefill(args, engine_config(args)))
    longctx = scenarios.add_parser(
        "longctx",
        help="first-question and follow-up TTFT on a long document, the "
        "follow-up's cached tokens and decode tok/s at that depth",
    )
    longctx.add_argument("--doc-tokens", type=int, default=8192, help="document tokens (default: 8192)")
    longctx.add_argument("--question-tokens", type=int, default=32, help="tokens per question (default: 32)")
    common(longctx, context=False)
    longctx.set_defaults(func=lambda args: cmd_bench_longctx(args, engine_config(args)))
    oracle = scenarios.add_parser(
        "spec-oracle",
        help="speculative decoding with an oracle drafter at a known acceptance profile, against plain decoding",
    )
    oracle.add_argument(
        "--oracle-profile",
        default=None,
        help="per-position acceptance probabilities, e.g. 0.9,0.8,0.7 (the draft length is their count)",
    )
    oracle.add_argument(
        "--oracle-al",
        type=float,
        default=3.0,
        help="without --oracle-profile: a constant profile of --draft-tokens positions with this "
        "expected acceptance length (default: 3)",
    )
    common(oracle)
    oracle.set_defaults(func=lambda args: cmd_bench_spec_oracle(args, engine_config(args)))
    tree = scenarios.add_parser(
        "tree-oracle",
        help="a tree of drafts against a chain of as many verify rows, with an oracle at a per-rank acceptance profile",
    )
    tree.add_argument("--rows", type=int, default=16, help="verify rows of both shapes (default: 16)")
    tree.add_argument(
        "--oracle-ranks",
        default="0.6,0.2,0.1,0.05",
        help="at every position, the chance that the right token is the candidate of each rank, given that the "
        "positions before were right (default: 0.6,0.2,0.1,0.05; the chain is right with the first)",
    )
    common(tree, max_tokens=128)
    tree.set_defaults(func=lambda args: cmd_bench_tree_oracle(args, engine_config(args)))
    drafter = scenarios.add_parser(
        "drafter", help="one drafter call's time against a target decode step, at a fixed --draft-tokens"
    )
    common(drafter, max_tokens=32)
    drafter.set_defaults(func=lambda args: cmd_bench_drafter(args, engine_config(args)))
    structured = scenarios.add_parser(
        "structured", help="decode tok/s with and without a structured-output constraint, and its cost per step"
    )
    structured.add_argument("--concurrency", default="1,32", help="stream counts (default: 1,32)")
    structured.add_argument(
        "--constraint", choices=("text", "json"), default="json", help="regex [a-z ]+ or a JSON schema (default)"
    )
    common(structured)
    structured.set_defaults(func=lambda args: cmd_bench_structured(args, engine_config(args)))
    prof = scenarios.add_parser("profile", help="kernel time breakdown of decode steps of C streams")
    prof.add_argument("--streams", type=int, default=1, help="streams decoding together (default: 1)")
    prof.add_argument("--steps", type=int, default=8, help="profiled decode steps (default: 8)")
    prof.add_argument("--top", type=int, default=25, help="kernels listed, by own time (default: 25)")
    common(prof, max_tokens=None, runs=False)
    prof.set_defaults(func=lambda args: cmd_bench_profile(args, engine_config(args)))


def add_bench_parser(commands, add_engine_flags, engine_config) -> None:
    bench = commands.add_parser("bench", help="benchmarks (JSON on stdout)")
    scenarios = bench.add_subparsers(dest="scenario", required=True)
    serve = scenarios.add_parser("serve", help="aggregate tok/s, TTFT and TPOT at several concurrencies")
    serve.add_argument("--concurrency", default="1,4,16,32", help="comma-separated stream counts (default: 1,4,16,32)")
    serve.add_argument("--requests-per-client", type=int, default=4, help="requests each client sends (default: 4)")
    serve.add_argument("--max-tokens", type=int, default=128, help="tokens per request, eos ignored (default: 128)")
    serve.add_argument("--runs", type=int, default=3, help="runs per level; the report gives medians (default: 3)")
    serve.add_argument("--plot", default=None, help="write an SVG chart of tok/s over concurrency here")
    serve.set_defaults(func=lambda args: cmd_bench_serve(args, engine_config(args)))
    data_parallel = scenarios.add_parser(
        "data-parallel",
        help="N data-parallel replicas at N x C clients against one replica at C: aggregate, TPOT and TTFT ratios",
    )
    data_parallel.add_argument(
        "--data-parallel-size", "-dp", type=int, default=2, help="replicas compared with one (default: 2)"
    )
    data_parallel.add_argument("--concurrency", type=int, default=4, help="clients per replica (default: 4)")
    data_parallel.add_argument(
        "--requests-per-client", type=int, default=4, help="requests each client sends (default: 4)"
    )
    data_parallel.add_argument(
        "--max-tokens", type=int, default=128, help="tokens per request, eos ignored (default: 128)"
    )
    data_parallel.add_argument(
        "--runs", type=int, default=3, help="runs per layout; the report gives medians (default: 3)"
    )
    data_parallel.add_argument("--out", default=None, help="also write the JSON report here")
    add_engine_flags(data_parallel)
    data_parallel.set_defaults(func=lambda args: cmd_bench_data_parallel(args, engine_config(args)))
    agents = scenarios.add_parser("agents", help="agents with long documents asking follow-ups")
    agents.add_argument("--agents", type=int, default=4, help="number of agents (default: 4)")
    agents.add_argument("--doc-chars", type=int, default=8000, help="characters per document (default: 8000)")
    agents.add_argument("--stagger", type=float, default=0.5, help="seconds between agents' starts (default: 0.5)")
    agents.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (default: 32)")
    agents.add_argument("--runs", type=int, default=3, help="repetitions; the report gives medians (default: 3)")
    agents.set_defaults(func=lambda args: cmd_bench_agents(args, engine_config(args)))
    spec = scenarios.add_parser("spec", help="plain decoding against each drafter and draft length, single stream")
    spec.add_argument("--drafters", default="ngram,draft,draft+ngram", help="comma-separated (default: all)")
    spec.add_argument("--k", default="1,3,7,15", help="comma-separated draft lengths (default: 1,3,7,15)")
    spec.add_argument(
        "--trees",
        default="",
        help="comma-separated tree sizes R (verify rows); each drafter also runs --speculative-tree R with "
        "--draft-tokens R-1, beside its chains (default: none)",
    )
    spec.add_argument("--max-tokens", type=int, default=64, help="tokens per request, eos ignored (default: 64)")
    spec.add_argument("--runs", type=int, default=3, help="repetitions; the report gives medians (default: 3)")
    spec.add_argument("--out", default=None, help="also write the JSON report here")
    add_engine_flags(spec)
    spec.set_defaults(func=lambda args: cmd_bench_spec(args, engine_config(args)))
    add_device_benches(scenarios, add_engine_flags, engine_config)
    for parser in (serve, agents):
        parser.add_argument(
            "--url",
            default=None,
            help="benchmark a running OpenAI-compatible server instead, e.g. http://127.0.0.1:8000/v1 "
            "(the trailing /v1 is optional)",
        )
        parser.add_argument("--api-key", default=None, help="API key of the --url server")
        parser.add_argument(
            "--served-model-name",
            default=None,
            help="model name to send to the --url server (default: the one it serves)",
        )
        parser.add_argument("--out", default=None, help="also write the JSON report here")
        add_engine_flags(parser)
