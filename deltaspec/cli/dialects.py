"""Flags that llama-server and vLLM users type and that are no deltaspec setting.

Each is accepted where deltaspec already does what it means in its own tool, and otherwise refused with one
sentence naming what to use instead: never ignored, never read with another meaning. Spellings of a deltaspec
setting (`-m`, `-c` / `--ctx-size`, `-t`, `-np` / `--parallel`, `--chat-template-file`, ...) are `aliases` of
the config fields instead (`deltaspec.config.engine`), and llama-cli's sampling spellings (`--temp`, `-n`,
`--repeat-penalty`) aliases of the sampling flags (`deltaspec.cli.flags`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

Refusal = Callable[[object], str | None]  # the value given ([] without one) -> the sentence refusing it, or None

ALL_LAYERS = 99  # llama.cpp users' spelling of "every layer" in -ngl (any count at least the model's layers)
TOOL_CALL_PARSERS = ("hermes", "qwen3_coder", "qwen3_xml")  # vLLM's parsers of the two Qwen formats
REASONING_PARSERS = ("qwen3",)  # vLLM's parser whose rules deltaspec's split follows (deltaspec.server.reasoning)
REASONING_FORMATS = ("auto", "deepseek")  # llama-server's formats that return the thinking as reasoning_content


@dataclass(frozen=True)
class ForeignFlag:
    """One flag of another tool: its spellings, whether it takes a value, and when deltaspec refuses it."""

    names: tuple[str, ...]
    takes_value: bool
    refusal: Refusal


class ForeignFlagAction(argparse.Action):
    """Stores nothing: a refused value is a usage error of the command, an accepted one changes nothing."""

    def __init__(self, option_strings: list[str], dest: str, refusal: Refusal, **kwargs) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)
        self.refusal = refusal

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if (sentence := self.refusal(values)) is not None:
            raise argparse.ArgumentError(None, sentence)


def accepted(value: object) -> None:
    """A flag whose meaning deltaspec always has."""
    return None


def refused(sentence: str) -> Refusal:
    """A flag deltaspec always refuses with `sentence`."""
    return lambda value: sentence


def one_of(choices: tuple[str, ...], sentence: str) -> Refusal:
    """A flag whose `choices` deltaspec does already; any other value is refused with `sentence`, whose `{value}`
    is the value given."""
    return lambda value: None if value in choices else sentence.format(value=repr(value))


def gpu_layers(value: object) -> str | None:
    """llama-server's -ngl: deltaspec runs every layer on --device, which all, auto, a negative count and 99 or more
    mean there; 0 means the CPU, and another count part of the model on the GPU."""
    if value in ("all", "auto"):
        return None
    try:
        layers = int(value)
    except (TypeError, ValueError):
        return f"-ngl takes a layer count, all or auto, got {value!r}; deltaspec runs every layer on --device."
    if layers < 0 or layers >= ALL_LAYERS:
        return None
    if layers == 0:
        return "-ngl 0 keeps every layer off the GPU; use --device cpu for that."
    return (
        f"-ngl {layers} offloads part of the model, which deltaspec does not do: it runs every layer on --device "
        f"(leave -ngl out, or give -ngl {ALL_LAYERS})."
    )


def sampling_default(names: tuple[str, ...], field: str) -> ForeignFlag:
    """llama-server's sampling flags set every request's default, which deltaspec serve reads from the model."""
    sentence = (
        f"{names[0]} sets llama-server's default for every request, and deltaspec serve takes those defaults from "
        f"the model's generation_config.json (a GGUF file's general.sampling keys); set {field} there or in each "
        "request."
    )
    return ForeignFlag(names, True, refused(sentence))


ENGINE_FLAGS = (
    ForeignFlag(("-ngl", "--n-gpu-layers", "--gpu-layers"), True, gpu_layers),
    ForeignFlag(("--trust-remote-code",), False, accepted),  # vLLM: deltaspec runs no code from a checkpoint
    ForeignFlag(("--jinja",), False, accepted),  # llama-server: the chat template is always rendered as Jinja
    ForeignFlag(
        ("--no-jinja",),
        False,
        refused(
            "deltaspec always renders the chat template as Jinja (the model's or --chat-template's); leave out "
            "--no-jinja."
        ),
    ),
)
SERVER_FLAGS = (
    ForeignFlag(
        ("--tool-call-parser",),
        True,
        one_of(
            TOOL_CALL_PARSERS,
            "--tool-call-parser {value} reads another model family's tool calls, and deltaspec always parses Qwen's "
            "JSON and XML <tool_call> blocks; leave the flag out, or give hermes, qwen3_coder or qwen3_xml.",
        ),
    ),
    ForeignFlag(("--enable-auto-tool-choice",), False, accepted),  # vLLM: deltaspec always parses tool calls
    ForeignFlag(("--enable-reasoning",), False, accepted),  # vLLM before 0.10: deltaspec always splits the thinking
    ForeignFlag(
        ("--reasoning-parser",),
        True,
        one_of(
            REASONING_PARSERS,
            "--reasoning-parser {value} is not deltaspec's: it always returns Qwen's <think> block as "
            "reasoning_content by the rules of vLLM's qwen3 parser; leave the flag out, or give qwen3.",
        ),
    ),
    ForeignFlag(
        ("--reasoning-format",),
        True,
        one_of(
            REASONING_FORMATS,
            "--reasoning-format {value} is not what deltaspec does: it always returns the thinking apart, as "
            "reasoning_content (llama-server's deepseek); leave the flag out, or give deepseek or auto.",
        ),
    ),
    sampling_default(("--temp", "--temperature"), "temperature"),
    sampling_default(("--top-k",), "top_k"),
    sampling_default(("--top-p",), "top_p"),
    sampling_default(("--min-p",), "min_p"),
    sampling_default(("--repeat-penalty",), "repetition_penalty"),
    sampling_default(("-n", "--predict", "--n-predict"), "max_tokens"),
)


def add_foreign_flags(parser: argparse.ArgumentParser, flags: tuple[ForeignFlag, ...]) -> None:
    """`flags`, hidden from --help (docs/cli.md lists them)."""
    for flag in flags:
        parser.add_argument(
            *flag.names,
            action=ForeignFlagAction,
            refusal=flag.refusal,
            nargs=None if flag.takes_value else 0,
            help=argparse.SUPPRESS,
        )
