"""The `deltaspec` command line. Engine and server flags are generated from the config dataclasses' fields."""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, fields

from deltaspec.bench.commands import add_bench_parser
from deltaspec.config import EngineConfig, ServerConfig
from deltaspec.errors import DeltaspecError


def add_config_flags(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """One flag per field of the dataclass `config_cls` (`api_key` -> `--api-key`), help from its metadata.
    Boolean fields get `--name` / `--no-name`; fields with metadata `cli: False` are Python-only."""
    for f in fields(config_cls):
        if not f.metadata.get("cli", True):
            continue
        default = None if f.default is MISSING else f.default
        names = ("--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ()))
        help_text = f"{f.metadata.get('help', '')} (default: {default})"
        if isinstance(default, bool):
            parser.add_argument(
                *names, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
            continue
        kind = type(default) if default is not None else str
        parser.add_argument(*names, dest=f.name, type=kind, default=default, help=help_text)


def config_from_args(args: argparse.Namespace, config_cls: type):
    return config_cls(**{f.name: getattr(args, f.name) for f in fields(config_cls) if hasattr(args, f.name)})


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, EngineConfig)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return config_from_args(args, EngineConfig)


def cmd_generate(args: argparse.Namespace) -> None:
    from deltaspec.llm import LLM
    from deltaspec.sample.params import SamplingParams

    llm = LLM(progress=True, **vars(engine_config(args)))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed_sample,
        ignore_eos=args.ignore_eos,
        repetition_penalty=args.repetition_penalty,
    )
    out = llm.generate([args.prompt], params)[0]
    print(args.prompt + out.outputs[0].text)
    m = out.metrics
    ttft = f"{m['time_to_first_token'] * 1000:.1f} ms" if m["time_to_first_token"] is not None else "n/a"
    tok_s = f"{m['decode_tok_s']:.1f}" if m["decode_tok_s"] is not None else "n/a"
    spec = (
        f" | {llm.engine.config.speculative}: AL {m['acceptance_length']:.2f} over {m['spec_rounds']} rounds"
        if m.get("spec_rounds")
        else ""
    )
    print(
        f"[prompt tokens: {m['num_prompt_tokens']} | new tokens: {m['num_generated_tokens']} | "
        f"time to first token: {ttft} | decode tok/s: {tok_s} | finish: {out.outputs[0].finish_reason} | "
        f"{llm.engine.config.device} {llm.engine.config.dtype}{spec}]",
        file=sys.stderr,
    )


def cmd_chat(args: argparse.Namespace) -> None:
    """One answer to --message, or a conversation on stdin (an empty line or EOF ends it)."""
    from deltaspec.llm import LLM
    from deltaspec.sample.params import SamplingParams

    llm = LLM(progress=True, **vars(engine_config(args)))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed_sample,
        repetition_penalty=args.repetition_penalty,
    )
    history = [{"role": "system", "content": args.system}] if args.system else []
    options = {"enable_thinking": args.thinking}
    turns = [args.message] if args.message is not None else iter(lambda: input("> "), "")
    try:
        for message in turns:
            history.append({"role": "user", "content": message})
            out = llm.chat(history, params, chat_template_kwargs=options)[0]
            answer = out.outputs[0].text
            history.append({"role": "assistant", "content": answer})
            print(answer, flush=True)
    except EOFError:
        pass


def cmd_ppl(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from deltaspec.evaluate import perplexity
    from deltaspec.llm import LLM

    try:
        text = "".join(Path(f).read_text() for f in args.file)
    except (OSError, UnicodeDecodeError) as exc:
        raise DeltaspecError(f"Could not read the text to score ({exc}).") from None
    llm = LLM(progress=True, **vars(engine_config(args)))
    result = perplexity(llm, text, window=args.window, max_windows=args.max_windows)
    print(
        json.dumps(
            {"model": str(llm.engine.model_dir), "dtype": llm.engine.config.dtype, "window": args.window, **result},
            indent=1,
        )
    )


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the memory budget of a configuration; exit 2 with the refusal when it does not fit."""
    from deltaspec.engine.planning import plan_for

    plan = plan_for(engine_config(args)).plan
    print(plan.table())
    if not plan.fits:
        print(f"error: {plan.refusal()}", file=sys.stderr)
        return 2
    return 0


def cmd_serve(args: argparse.Namespace) -> None:
    from deltaspec.server.app import run_server

    run_server(engine_config(args), config_from_args(args, ServerConfig))


def add_sampling_flags(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help=f"most new tokens (default: {max_tokens})")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 for greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    parser.add_argument(
        "--seed-sample",
        "--sample-seed",
        dest="seed_sample",
        type=int,
        default=None,
        help="seed of this request's sampling (default: derived from --seed)",
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide logits of tokens already seen by this (default: 1, off)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaspec", description="Inference for hybrid GDN / attention LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete one prompt and print the text and decode stats")
    gen.add_argument("--prompt", required=True, help="text to complete")
    add_sampling_flags(gen, max_tokens=64)
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely, 0: off (default: 0)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)

    chat = commands.add_parser("chat", help="answer chat messages with the model's chat template")
    chat.add_argument("--message", default=None, help="answer this one message and exit (default: read stdin)")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument(
        "--thinking",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let the model think before answering (chat template's enable_thinking)",
    )
    add_sampling_flags(chat, max_tokens=256)
    add_engine_flags(chat)
    chat.set_defaults(func=cmd_chat)

    ppl = commands.add_parser("ppl", help="perplexity and bits per byte of the model on text files (JSON)")
    ppl.add_argument("file", nargs="+", help="text files, scored as one stream")
    ppl.add_argument("--window", type=int, default=1024, help="tokens per scored window (default: 1024)")
    ppl.add_argument("--max-windows", type=int, default=None, help="score at most this many windows")
    add_engine_flags(ppl)
    ppl.set_defaults(func=cmd_ppl)

    plan = commands.add_parser("plan", help="memory budget of a configuration: weights, KV, GDN states, workspace")
    add_engine_flags(plan)
    plan.set_defaults(func=cmd_plan)

    serve = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_flags(serve)
    add_config_flags(serve, ServerConfig)
    serve.set_defaults(func=cmd_serve)

    add_bench_parser(commands, add_engine_flags, engine_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except DeltaspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
