"""Flags as llama-server, llama-cli and vLLM users type them: each accepted spelling means what it means in its own
tool (the configuration it gives is exactly the one deltaspec's own spelling gives), each refused one is a usage
error of its subcommand naming what to use; no flag is abbreviated; `--version`; `chat MESSAGE --stop`;
`--chat-template`; vLLM's speculative config and dict prompts in `LLM`."""

from __future__ import annotations

import re

import pytest

from deltaspec import LLM, DeltaspecError, SamplingParams
from deltaspec.cli import build_parser, config_from_args, engine_config, main
from deltaspec.config.engine import EngineConfig
from deltaspec.config.server import ServerConfig
from deltaspec.model.tokenizer import Tokenizer
from deltaspec.model.weights import default_model_path

MESSAGE = "Write a function that adds two numbers."
CUSTOM_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\nAnswer in one line: {% endif %}"
)


def configs(command: str, *flags: str) -> tuple[EngineConfig, ServerConfig | None]:
    args = build_parser().parse_args([command, *flags])
    return engine_config(args), config_from_args(args, ServerConfig) if command == "serve" else None


@pytest.mark.parametrize(
    "foreign, own",
    [
        (["-m", "org/model"], ["--model", "org/model"]),  # llama-server
        (["-c", "512"], ["--max-model-len", "512"]),
        (["--ctx-size", "512"], ["--max-model-len", "512"]),
        (["-t", "2"], ["--threads", "2"]),
        (["-t2"], ["--threads", "2"]),
        (["-np", "4"], ["--max-num-seqs", "4"]),
        (["--parallel", "4"], ["--max-num-seqs", "4"]),
        (["-ngl", "99"], []),  # deltaspec runs every layer on --device, as these ask
        (["-ngl", "999"], []),
        (["-ngl", "-1"], []),
        (["--n-gpu-layers", "all"], []),
        (["--gpu-layers", "auto"], []),
        (["--jinja"], []),  # deltaspec always renders the Jinja chat template
        (["--chat-template-file", "t.jinja"], ["--chat-template", "t.jinja"]),
        (["--trust-remote-code"], []),  # vLLM: no code from a checkpoint ever runs
        (["--tool-call-parser", "hermes"], []),  # both Qwen tool-call formats are always parsed
        (["--tool-call-parser", "qwen3_coder"], []),
        (["--tool-call-parser", "qwen3_xml", "--enable-auto-tool-choice"], []),
        (["--reasoning-parser", "qwen3"], []),  # the thinking is always returned apart by vLLM's qwen3 rules
        (["--enable-reasoning"], []),
        (["--reasoning-format", "deepseek"], []),
        (["--reasoning-format", "auto"], []),
        (["-tp", "2"], ["--tensor-parallel-size", "2"]),
        (["--ngram-prompt-lookup-max", "4"], ["--prompt-lookup-max", "4"]),
        (["--max-streams", "3"], ["--max-num-seqs", "3"]),
    ],
)
def test_foreign_spellings_mean_what_they_mean_there(foreign, own):
    assert configs("serve", *foreign) == configs("serve", *own)


@pytest.mark.parametrize(
    "flags, engine, server",
    [
        (["-t", "2"], {"threads": 2}, {}),
        (["-tp", "2"], {"tensor_parallel_size": 2}, {}),
        (["-c", "512", "-np", "3"], {"max_model_len": 512, "max_num_seqs": 3}, {}),
        (["--served-model-name", "qwen", "--api-key", "k"], {}, {"served_model_name": "qwen", "api_key": "k"}),
        (["--host", "0.0.0.0", "--port", "9000"], {}, {"host": "0.0.0.0", "port": 9000}),
        (["--gpu-memory-utilization", "0.5"], {"gpu_memory_utilization": 0.5}, {}),
        (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}, {}),
        (
            ["--prompt-lookup-min", "1", "--prompt-lookup-max", "3"],
            {"prompt_lookup_min": 1, "prompt_lookup_max": 3},
            {},
        ),
    ],
)
def test_spellings_set_exactly_their_field(flags, engine, server):
    """`-t 2` is threads and nothing else (no longer a prefix of -tp); each flag sets its field only."""
    assert configs("serve", *flags) == (EngineConfig.from_flat(**engine), ServerConfig(**server))


def test_llama_cli_sampling_spellings():
    args = build_parser().parse_args(["generate", "x", "--temp", "0.5", "-n", "7", "--repeat-penalty", "1.1"])
    assert (args.temperature, args.max_tokens, args.repetition_penalty) == (0.5, 7, 1.1)
    for flag in ("--predict", "--n-predict"):
        assert build_parser().parse_args(["chat", "hi", flag, "9"]).max_tokens == 9


def usage_error(capsys, *argv: str) -> tuple[str, str]:
    """The usage line and the one error sentence of an argv that argparse refuses with exit status 2."""
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 2, err
    assert lines[1].endswith("."), lines[1]
    return lines[0], lines[1]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["-ngl", "40"], ["-ngl 40", "part of the model", "-ngl 99"]),
        (["-ngl", "0"], ["--device cpu"]),
        (["--n-gpu-layers", "most"], ["'most'", "all or auto"]),
        (["--no-jinja"], ["leave out --no-jinja"]),
        (["--tool-call-parser", "mistral"], ["'mistral'", "hermes, qwen3_coder or qwen3_xml"]),
        (["--reasoning-parser", "deepseek_r1"], ["'deepseek_r1'", "qwen3"]),
        (["--reasoning-format", "none"], ["'none'", "deepseek"]),
        (["--temp", "0.7"], ["--temp", "generation_config.json", "temperature"]),
        (["--temperature", "0.7"], ["--temp", "temperature"]),
        (["-n", "100"], ["-n", "max_tokens"]),
        (["--repeat-penalty", "1.1"], ["repetition_penalty"]),
        (["--bogus"], ["--bogus", "'deltaspec serve --help'"]),
        (["--max-model", "512"], ["--max-model", "'deltaspec serve --help'"]),  # no abbreviations
    ],
)
def test_refused_spellings_are_a_usage_error_naming_the_alternative(flags, words, capsys):
    usage, sentence = usage_error(capsys, "serve", *flags)
    assert usage == "usage: deltaspec serve [options] [MODEL]"
    assert sentence.startswith("deltaspec serve: error: ")
    for word in words:
        assert word in sentence, (word, sentence)


@pytest.mark.parametrize(
    "argv, usage",
    [
        (["chat", "--bogus"], "usage: deltaspec chat [options] [MESSAGE]"),
        (["generate", "x", "--ignore"], "usage: deltaspec generate [options] [PROMPT]"),
        (["ppl", "f.txt", "--windo", "8"], "usage: deltaspec ppl [options] file [file ...]"),
        (["bench", "decode", "--bogus"], "usage: deltaspec bench decode [options]"),
    ],
)
def test_an_unknown_flag_shows_its_subcommands_usage(argv, usage, capsys):
    assert usage_error(capsys, *argv)[0] == usage


@pytest.mark.parametrize(
    "argv, words",
    [
        (["serve", "--port", "99999"], ["--port", "0 to 65535", "99999"]),
        (["serve", "--port", "-1"], ["--port", "0 to 65535", "-1"]),
        (["plan", "-t", "0"], ["threads", "at least 1"]),
        (["plan", "--chat-template", "chatml"], ["'chatml'", "neither a file nor a Jinja template"]),
        (["plan", "--prompt-lookup-min", "6"], ["prompt_lookup_min <= prompt_lookup_max", "6 and 5"]),
    ],
)
def test_bad_values_are_one_sentence(argv, words, capsys):
    assert main([*argv, "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("error: ") and err.strip().endswith(".")
    for word in words:
        assert word in err, (word, err)


def test_version(capsys):
    import deltaspec

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"deltaspec {deltaspec.__version__}\n"
    assert main(["version"]) == 0
    assert capsys.readouterr().out == f"deltaspec {deltaspec.__version__}\n"


def chat(capsys, *argv: str) -> tuple[str, str]:
    assert main(["chat", *argv, "--max-tokens", "24", "--temperature", "0", "--device", "cpu"]) == 0
    return capsys.readouterr()


def test_chat_takes_the_message_as_an_argument_and_stops_at_stop(capsys):
    answer, _ = chat(capsys, "--message", MESSAGE)
    assert chat(capsys, MESSAGE)[0] == answer
    assert chat(capsys, MESSAGE, "--message", MESSAGE)[0] == answer
    words = re.findall(r"\w{3,}", answer)
    assert len(words) >= 3, answer
    stop = words[2]
    assert chat(capsys, MESSAGE, "--stop", "@@never@@", "--stop", stop)[0] == answer[: answer.index(stop)] + "\n"
    assert main(["chat", "hi", "--message", "ho"]) == 2
    assert "given twice" in capsys.readouterr().err


def prompt_tokens(err: str) -> int:
    return int(re.search(r"prompt tokens: (\d+) ", err).group(1))


def test_chat_template_replaces_the_models(tmp_path, capsys):
    """vLLM's and llama-server's --chat-template, as a file or as the template itself, and llama-server's
    --chat-template-file: the prompt is rendered with it; broken Jinja is one sentence."""
    messages = [{"role": "user", "content": MESSAGE}]
    tokenizer = Tokenizer.from_dir(default_model_path())
    custom = tokenizer.with_chat_template(CUSTOM_TEMPLATE).apply_chat_template(messages)
    assert custom.endswith("Answer in one line: ") and custom != tokenizer.apply_chat_template(messages)
    template = tmp_path / "template.jinja"
    template.write_text(CUSTOM_TEMPLATE)
    for flags in (["--chat-template", str(template)], ["--chat-template-file", str(template)]):
        assert prompt_tokens(chat(capsys, MESSAGE, "--max-tokens", "1", *flags)[1]) == len(tokenizer.encode(custom))
    llm = LLM(chat_template=CUSTOM_TEMPLATE, device="cpu")
    assert llm.chat_prompt(messages)["prompt"] == custom
    assert main(["chat", MESSAGE, "--chat-template", "{% if %}", "--device", "cpu"]) == 2
    assert "--chat-template is not valid Jinja (line 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def text_llm(text_checkpoint):
    return LLM(str(text_checkpoint), dtype="float64", device="cpu")


def test_dict_prompts_as_vllm_takes_them(text_llm):
    """vLLM's TextPrompt {"prompt": ...} is the text; TokensPrompt {"prompt_token_ids": ...} the ids; other keys
    (mm_processor_kwargs, ...) are refused rather than ignored, and images to a text-only model too."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (text,) = text_llm.generate("def add(a, b):", params)
    as_dict, as_ids = text_llm.generate(
        [{"prompt": "def add(a, b):"}, {"prompt_token_ids": text.prompt_token_ids}], params
    )
    assert as_dict.prompt == "def add(a, b):" and as_dict.prompt_token_ids == text.prompt_token_ids
    assert as_dict.outputs[0].token_ids == as_ids.outputs[0].token_ids == text.outputs[0].token_ids
    with pytest.raises(DeltaspecError, match="unknown key.* mm_processor_kwargs; deltaspec reads prompt"):
        text_llm.generate({"prompt": "x", "mm_processor_kwargs": {}}, params)
    with pytest.raises(DeltaspecError, match="takes no images"):  # a text-only model given an image
        text_llm.generate({"prompt": "x", "multi_modal_data": {"image": b"\x89PNG"}}, params)
    with pytest.raises(DeltaspecError, match="needs a 'prompt' string or a 'prompt_token_ids' list"):
        text_llm.generate({"prompt": 5}, params)


def test_speculative_config_dict_as_vllm_takes_it(text_checkpoint, text_llm):
    """`LLM(speculative_config={...})` with vLLM's n-gram keys runs the n-gram drafter with those bounds; its
    greedy output is the plain greedy output. One bound given, the other takes its value, as in vLLM."""
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    llm = LLM(str(text_checkpoint), dtype="float64", device="cpu", speculative_config=config)
    drafter = llm.engine.speculator.drafter
    assert (llm.engine.config.speculation.speculative, llm.engine.config.speculation.draft_tokens) == ("ngram", 3)
    assert (drafter.name, drafter.min_n, drafter.max_n) == ("ngram", 2, 4)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    assert (
        llm.generate(prompt, params)[0].outputs[0].token_ids
        == text_llm.generate(prompt, params)[0].outputs[0].token_ids
    )
    one = LLM(str(text_checkpoint), device="cpu", speculative_config={"method": "ngram", "prompt_lookup_max": 3})
    assert (one.engine.speculator.drafter.min_n, one.engine.speculator.drafter.max_n) == (3, 3)
    with pytest.raises(DeltaspecError, match="speculative_config sets draft_tokens 3 but draft_tokens 5 was given"):
        LLM(str(text_checkpoint), device="cpu", speculative_config=config, draft_tokens=5)
    with pytest.raises(DeltaspecError, match="speculative_config is a dict"):
        LLM(str(text_checkpoint), device="cpu", speculative_config='{"method": "ngram"}')
