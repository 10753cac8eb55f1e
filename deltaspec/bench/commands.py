"""`deltaspec bench serve|agents|spec`: run a scenario (serve and agents against an in-process server or --url) and
write JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from deltaspec.bench.agents import bench_agents
from deltaspec.bench.client import Client
from deltaspec.bench.plot import line_chart
from deltaspec.bench.serve import bench_serve
from deltaspec.bench.stats import commit


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextmanager
def target(args: argparse.Namespace, engine_config):
    """(client, identity, request log) for --url, or for a server started here with the engine flags."""
    if args.url:
        yield Client(args.url, args.api_key, args.served_model_name), {"server": args.url}, None
        return
    from deltaspec.bench.local_server import local_server

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "requests.jsonl"
        with local_server(engine_config, log) as (url, engine):
            identity = {"model": str(engine.model_dir), "device": str(engine.device), "dtype": engine.config.dtype,
                        "max_model_len": engine.config.max_model_len, "max_num_seqs": engine.config.max_num_seqs,
                        "speculative": "none"}
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
    write_report({"benchmark": "serve", "commit": commit(), **identity, "max_tokens": args.max_tokens,
                  "requests_per_client": args.requests_per_client, "runs": args.runs, "levels": rows}, args.out)
    if args.plot:
        svg = line_chart("deltaspec bench serve", "concurrent streams", "tok/s", levels,
                         {"aggregate (C x 1000 / mean TPOT)": [r["aggregate_tok_s"] for r in rows],
                          "output tokens / wall time": [r["output_tok_s_wall"] for r in rows]})
        Path(args.plot).write_text(svg)
        say(f"wrote {args.plot}")


def cmd_bench_agents(args: argparse.Namespace, engine_config) -> None:
    with target(args, engine_config) as (client, identity, _):
        runs = [bench_agents(client, args.agents, args.doc_chars, args.stagger, args.max_tokens, progress=say)
                for _ in range(args.runs)]
    medians = {key: statistics.median(run[key][subkey] if subkey else run[key] for run in runs)
               for key, subkey in (("first_turn_wait_s", "p50"), ("follow_up_wait_s", "p50"),
                                   ("follow_up_wait_max_s", None))}
    write_report({"benchmark": "agents", "commit": commit(), **identity, "agents": args.agents,
                  "doc_chars": args.doc_chars, "stagger_s": args.stagger, "max_tokens": args.max_tokens,
                  "median_over_runs": medians, "runs": runs}, args.out)


def cmd_bench_spec(args: argparse.Namespace, engine_config) -> None:
    from dataclasses import replace

    from deltaspec.bench.spec import measure

    configs = [replace(engine_config, speculative="none")]
    for drafter in args.drafters.split(","):
        configs += [replace(engine_config, speculative=drafter, draft_tokens=k) for k in map(int, args.k.split(","))]
    rows = [measure(config, args.max_tokens, args.runs, progress=say) for config in configs]
    plain = rows[0]["decode_tok_s"]
    for row in rows:
        row["speedup"] = row["decode_tok_s"] / plain
    write_report({"benchmark": "spec", "commit": commit(), "model": engine_config.model or "embedded default",
                  "max_tokens": args.max_tokens, "runs": args.runs, "configurations": rows}, args.out)


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
    spec.add_argument("--max-tokens", type=int, default=64, help="tokens per request, eos ignored (default: 64)")
    spec.add_argument("--runs", type=int, default=3, help="repetitions; the report gives medians (default: 3)")
    spec.add_argument("--out", default=None, help="also write the JSON report here")
    add_engine_flags(spec)
    spec.set_defaults(func=lambda args: cmd_bench_spec(args, engine_config(args)))
    for parser in (serve, agents):
        parser.add_argument("--url", default=None, help="benchmark a running OpenAI-compatible server instead")
        parser.add_argument("--api-key", default=None, help="API key of the --url server")
        parser.add_argument("--served-model-name", default=None, help="model name to send to the --url server")
        parser.add_argument("--out", default=None, help="also write the JSON report here")
        add_engine_flags(parser)
