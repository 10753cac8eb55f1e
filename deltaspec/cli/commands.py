"""The `deltaspec` subcommands: their arguments, and the small ones' bodies (ppl, kl, quantize, plan, serve); generate
and chat live in `deltaspec.cli.generation`, the bench scenarios in `deltaspec.bench.commands`."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from dataclasses import fields

from deltaspec.bench.commands import add_bench_parser
from deltaspec.cli.dialects import SERVER_FLAGS, add_foreign_flags
from deltaspec.cli.flags import add_config_flags, add_engine_flags, add_sampling_flags, config_from_args, engine_config
from deltaspec.cli.generation import CHAT_MAX_TOKENS, GENERATE_MAX_TOKENS, cmd_chat, cmd_generate
from deltaspec.cli.parser import CommandParser
from deltaspec.config.server import ServerConfig
from deltaspec.errors import DeltaspecError


def cmd_ppl(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from deltaspec.evaluate import perplexity
    from deltaspec.llm import LLM

    try:
        text = "".join(Path(f).read_text() for f in args.file)
    except (OSError, UnicodeDecodeError) as exc:
        raise DeltaspecError(f"Could not read the text to score ({exc}).") from None
    llm = LLM(progress=True, **engine_config(args).flat())
    result = perplexity(llm, text, window=args.window, max_windows=args.max_windows)
    print(
        json.dumps(
            {
                "model": str(llm.engine.model_dir),
                "dtype": llm.engine.config.load.dtype,
                "window": args.window,
                **result,
            },
            indent=1,
        )
    )


def cmd_kl(args: argparse.Namespace) -> None:
    import json

    from deltaspec.evaluate_kl import read_corpus, run_kl

    text = read_corpus(args.file)
    base_options = {
        "state_dtype": args.base_state_dtype,
        "kv_cache_dtype": args.base_kv_cache_dtype,
        "fp8_activations": args.base_fp8_activations,
    }
    sources = (args.base, args.base_dtype, base_options, args.base_logits, args.save_base)
    print(json.dumps(run_kl(engine_config(args), text, *sources, args.window, args.max_windows), indent=1))


def cmd_quantize(args: argparse.Namespace) -> None:
    from deltaspec.quantize.command import run_quantize, run_random_quantize, summary_text

    if args.shape is not None and not args.random_weights:
        raise DeltaspecError("--shape names the shape of --random-weights; add --random-weights or leave out --shape.")
    if args.random_weights:
        if args.model_tag is not None or args.calibration:
            raise DeltaspecError("--random-weights writes a shape's random weights; leave out MODEL and --calibration.")
        print(summary_text(run_random_quantize(args.shape, args.out, args.type, args.seed, args.device)))
        return
    summary = run_quantize(
        args.model_tag,
        args.out,
        args.type,
        args.calibration,
        args.calibration_windows,
        args.window,
        args.dtype,
        args.device,
    )
    print(summary_text(summary))


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the memory budget of a configuration; exit 2 with the refusal when it does not fit."""
    from deltaspec.engine.planning import plan_for

    plan = plan_for(engine_config(args)).plan
    print(plan.table())
    if not plan.fits:
        print(f"error: {plan.refusal()}", file=sys.stderr)
        return 2
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    server_config = config_from_args(args, ServerConfig)
    if server_config.data_parallel_backend == "ray":
        from deltaspec.server.data_parallel.ray_serve import serve_on_ray

        return serve_on_ray(engine_config(args), server_config)
    if server_config.data_parallel_size > 1:
        from deltaspec.server.data_parallel.serve import serve_data_parallel

        return serve_data_parallel(engine_config(args), server_config)
    from deltaspec.server.app import run_server

    run_server(engine_config(args), server_config)
    return 0


def version_text() -> str:
    """`deltaspec VERSION`, the installed package's version (as vLLM's --version reads it)."""
    try:
        return f"deltaspec {importlib.metadata.version('deltaspec')}"
    except importlib.metadata.PackageNotFoundError:
        return "deltaspec (version unknown: not installed as a package)"


def cmd_version(args: argparse.Namespace) -> None:
    print(version_text())


class PrintVersion(argparse.Action):
    """--version: print `version_text()` and exit, looked up only when asked."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="deltaspec", description="Inference for hybrid GDN / attention LLMs.")
    parser.add_argument("--version", action=PrintVersion, help="print deltaspec's version and exit")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser(
        "generate", help="complete one prompt, streaming the text to stdout, then print decode stats on stderr"
    )
    gen.add_argument("prompt_text", nargs="?", metavar="PROMPT", help="text to complete (or --prompt)")
    gen.add_argument("--prompt", default=None, help="text to complete, as a flag")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    add_sampling_flags(gen, max_tokens=GENERATE_MAX_TOKENS)
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)

    chat = commands.add_parser("chat", help="answer chat messages with the model's chat template, streaming")
    chat.add_argument("message_text", nargs="?", metavar="MESSAGE", help="answer this one message and exit")
    chat.add_argument("--message", default=None, help="the message, as a flag (default: a conversation on stdin)")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument(
        "--image",
        action="append",
        metavar="FILE",
        help="an image file the first message shows the model (repeatable; a multimodal checkpoint only)",
    )
    chat.add_argument(
        "--thinking",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let the model think before answering, or not (the chat template's enable_thinking; default: the "
        "template's own); the reasoning is shown on stderr",
    )
    add_sampling_flags(chat, max_tokens=CHAT_MAX_TOKENS)
    add_engine_flags(chat)
    chat.set_defaults(func=cmd_chat)

    ppl = commands.add_parser("ppl", help="perplexity and bits per byte of the model on text files (JSON)")
    ppl.add_argument("file", nargs="+", help="text files, scored as one stream")
    ppl.add_argument("--window", type=int, default=1024, help="tokens per scored window (default: 1024)")
    ppl.add_argument("--max-windows", type=int, default=None, help="score at most this many windows")
    add_engine_flags(ppl)
    ppl.set_defaults(func=cmd_ppl)

    kl = commands.add_parser(
        "kl",
        help="KL divergence of the model's next-token distributions from a base model's on text files, top-1 "
        "agreement and both perplexities (JSON), as llama-perplexity --kl-divergence",
    )
    kl.add_argument("file", nargs="+", help="text files, scored as one stream")
    base = kl.add_mutually_exclusive_group(required=True)
    base.add_argument("--base", metavar="BASE", help="the base checkpoint (directory or hub id) to compare with")
    base.add_argument("--base-logits", metavar="F", help="the base's logits saved by --save-base, instead of --base")
    kl.add_argument("--base-dtype", default=None, help="dtype of the base (default: --dtype)")
    kl.add_argument(
        "--base-state-dtype",
        default="auto",
        help="GDN state dtype of the base (default auto: float32, float64 for a float64 base), so that --state-dtype "
        "bfloat16 measures the narrower state against the full one",
    )
    kl.add_argument(
        "--base-kv-cache-dtype",
        default="auto",
        help="KV cache dtype of the base (default auto: its dtype), so that --kv-cache-dtype fp8_e4m3 measures the "
        "quantized cache against the full one",
    )
    kl.add_argument(
        "--base-fp8-activations",
        default="none",
        help="FP8 activations of the base (default none: bf16 activations), so that --fp8-activations dynamic "
        "measures W8A8 prefill against the same FP8 weights' W8A16",
    )
    kl.add_argument(
        "--save-base",
        metavar="F",
        help="also write the base's logits and the token ids to F (safetensors) for --base-logits; without --model "
        "only the base runs",
    )
    kl.add_argument("--window", type=int, default=1024, help="tokens per scored window (default: 1024)")
    kl.add_argument("--max-windows", type=int, default=None, help="score at most this many windows")
    add_engine_flags(kl)
    kl.set_defaults(func=cmd_kl)

    quant = commands.add_parser(
        "quantize",
        help="write the model as a GGUF file that llama.cpp loads: float, a llama.cpp preset or one block type, "
        "optionally with an importance matrix measured on calibration text",
    )
    quant.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="float checkpoint: directory, hub id or .gguf (default: the embedded model)",
    )
    quant.add_argument("out", metavar="OUT.gguf", help="the GGUF file to write")
    quant.add_argument(
        "--type",
        required=True,
        help="q4_k_m, q5_k_m, q6_k, q8_0 (llama-quantize's presets), q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, "
        "iq4_nl, iq4_xs (one type, as llama-quantize --pure), f16, bf16, f32 (as convert_hf_to_gguf.py)",
    )
    quant.add_argument(
        "--calibration", nargs="+", metavar="FILE", help="text files to measure the importance matrix on (imatrix)"
    )
    quant.add_argument(
        "--calibration-windows", type=int, default=None, help="use at most this many windows of it (default: all)"
    )
    quant.add_argument("--window", type=int, default=512, help="tokens per calibration window (default: 512)")
    quant.add_argument("--dtype", default="auto", help="dtype of the calibration run (default: auto)")
    quant.add_argument(
        "--device",
        default="auto",
        help="device of the calibration run and the quantization, or of the random draws (default: auto)",
    )
    quant.add_argument(
        "--random-weights",
        action="store_true",
        help="write random weights of --shape instead of a checkpoint's (the weights --random-weights --quant TYPE "
        "draws with the same --seed on the same device), with a minimal tokenizer; for benchmarks against llama.cpp",
    )
    quant.add_argument(
        "--shape",
        default=None,
        help="model shape for --random-weights: qwen3.5-0.8b, qwen3.5-9b, qwen3.5-27b, qwen3.5-35b-a3b, "
        "qwen3-next-80b-a3b",
    )
    quant.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    quant.set_defaults(func=cmd_quantize)

    plan = commands.add_parser("plan", help="memory budget of a configuration: weights, KV, GDN states, workspace")
    add_engine_flags(plan)
    plan.set_defaults(func=cmd_plan)

    serve = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    serve.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="checkpoint directory or Hugging Face hub id (or --model)"
    )
    add_engine_flags(serve)
    add_foreign_flags(add_config_flags(serve, fields(ServerConfig), "server options"), SERVER_FLAGS)
    serve.set_defaults(func=cmd_serve)

    add_bench_parser(commands, add_engine_flags, engine_config)
    commands.add_parser("version", help="print deltaspec's version (as --version)").set_defaults(func=cmd_version)
    return parser
