"""Flags shared by the `deltaspec` commands and the values built from them.

Engine and server flags are generated from the config dataclasses' fields: one visible spelling per field,
its `aliases` metadata accepted but hidden from --help, each default shown once. A flag the user does not
give leaves its attribute unset, so the dataclass default applies and `given_fields` tells what was typed
(which `--speculative-config` needs to find conflicts). Sampling flags default to the model's generation
config, then to the command's own defaults.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, fields, replace

from deltaspec.cli.dialects import ENGINE_FLAGS, add_foreign_flags
from deltaspec.config.engine import EngineConfig, engine_fields
from deltaspec.errors import DeltaspecError
from deltaspec.sample.params import SamplingParams
from deltaspec.spec.speculative_config import SPECULATIVE_CONFIG_HELP, parse_speculative_json, speculative_fields

GENERATION_CONFIG = "the model's generation_config.json"


def help_with_default(help_text: str, default: object) -> str:
    """`help_text` with its default appended once: not when the text states it already, not when it is None."""
    if default is None or "default" in help_text.lower():
        return help_text
    return f"{help_text} (default: {default})"


def add_config_flags(
    parser: argparse.ArgumentParser, settings: tuple[Field, ...], title: str
) -> argparse._ArgumentGroup:
    """One flag per dataclass field of `settings` (`api_key` -> `--api-key`), help from its metadata, in an
    argument group named `title`. Boolean fields get `--name` / `--no-name`; the value's type is metadata `type`, else
    the default's (str for None); fields with metadata `cli: False` are Python-only; names in metadata `aliases`
    work too but stay out of --help."""
    group = parser.add_argument_group(title)
    for f in settings:
        if not f.metadata.get("cli", True):
            continue
        default = None if f.default is MISSING else f.default
        if isinstance(default, bool):
            kind = {"action": argparse.BooleanOptionalAction}
        else:
            kind = {"type": f.metadata.get("type") or (type(default) if default is not None else str)}
        help_text = help_with_default(f.metadata.get("help", ""), default)
        flag = "--" + f.name.replace("_", "-")
        group.add_argument(flag, dest=f.name, default=argparse.SUPPRESS, help=help_text, **kind)
        for alias in f.metadata.get("aliases", ()):
            group.add_argument(alias, dest=f.name, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kind)
    return group


def given_fields(args: argparse.Namespace, settings: tuple[Field, ...]) -> dict:
    """The fields of `settings` whose flags the user gave."""
    return {f.name: getattr(args, f.name) for f in settings if hasattr(args, f.name)}


def config_from_args(args: argparse.Namespace, config_cls: type):
    return config_cls(**given_fields(args, fields(config_cls)))


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The EngineConfig flags, --speculative-config, and llama-server's and vLLM's engine flags that are no
    setting here (`deltaspec.cli.dialects`)."""
    group = add_config_flags(parser, engine_fields(), "engine options")
    group.add_argument("--speculative-config", metavar="JSON", default=None, help=SPECULATIVE_CONFIG_HELP)
    add_foreign_flags(group, ENGINE_FLAGS)


def one_value(what: str, positional: str | None, flag_name: str, flag_value: str | None) -> str | None:
    """The value given as the positional argument or as the flag; both with different values is an error."""
    if positional is not None and flag_value is not None and positional != flag_value:
        raise DeltaspecError(
            f"The {what} is given twice, as an argument ({positional!r}) and as {flag_name} ({flag_value!r}); "
            "give it once."
        )
    return positional if positional is not None else flag_value


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the flags given, the positional MODEL (serve) and --speculative-config."""
    given = given_fields(args, engine_fields())
    model = one_value("model", getattr(args, "model_tag", None), "--model", given.get("model"))
    if model is not None:
        given["model"] = model
    if args.speculative_config is not None:
        given.update(speculative_fields(parse_speculative_json(args.speculative_config), given))
    return EngineConfig.from_flat(**given)


def _default(name: str):
    return next(f.default for f in fields(SamplingParams) if f.name == name)


LLAMA_SAMPLING_ALIASES = {  # llama-cli's spellings of the sampling flags, hidden from --help
    "--max-tokens": ("-n", "--predict", "--n-predict"),
    "--temperature": ("--temp",),
    "--repetition-penalty": ("--repeat-penalty",),
}


def add_sampling_flags(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    """--max-tokens, --temperature, --top-p, --top-k, --repetition-penalty, --stop, --sample-seed: unset, each falls
    back to the model's generation config, then to `max_tokens` (for --max-tokens) or SamplingParams' default."""
    group = parser.add_argument_group("sampling options")
    group.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"most new tokens (default: max_new_tokens of {GENERATION_CONFIG}, else {max_tokens})",
    )
    for flag, kind, meaning in (
        ("--temperature", float, "0 for greedy"),
        ("--top-p", float, "nucleus sampling mass"),
        ("--top-k", int, "sample among the k most likely, 0: off"),
        ("--repetition-penalty", float, "divide logits of tokens already seen by this, 1: off"),
    ):
        name = flag.removeprefix("--").replace("-", "_")
        group.add_argument(
            flag, type=kind, default=None, help=f"{meaning} (default: {GENERATION_CONFIG}, else {_default(name):g})"
        )
    for flag, aliases in LLAMA_SAMPLING_ALIASES.items():
        dest = flag.removeprefix("--").replace("-", "_")
        kind = int if flag == "--max-tokens" else float
        group.add_argument(*aliases, dest=dest, type=kind, default=None, help=argparse.SUPPRESS)
    group.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        default=None,
        help="end the answer before this text (may be given several times)",
    )
    group.add_argument(
        "--sample-seed",
        type=int,
        default=None,
        help="seed of this request's sampling (default: derived from --seed)",
    )
    group.add_argument("--seed-sample", dest="sample_seed", type=int, default=None, help=argparse.SUPPRESS)


def sampling_params(llm, args: argparse.Namespace, max_tokens: int) -> SamplingParams:
    """`llm`'s default SamplingParams (its generation config) with the sampling flags the user gave; --max-tokens
    falls back to `max_tokens` when the generation config sets no max_new_tokens."""
    chosen = {
        name: getattr(args, name)
        for name in ("max_tokens", "temperature", "top_p", "top_k", "repetition_penalty")
        if getattr(args, name) is not None
    }
    if args.sample_seed is not None:
        chosen["seed"] = args.sample_seed
    if args.stop is not None:
        chosen["stop"] = args.stop
    if getattr(args, "ignore_eos", False):
        chosen["ignore_eos"] = True
    if "max_tokens" not in chosen and "max_tokens" not in llm.engine.sampling_defaults:
        chosen["max_tokens"] = max_tokens
    return replace(llm.get_default_sampling_params(), **chosen)
