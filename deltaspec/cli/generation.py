"""`deltaspec generate` and `deltaspec chat`: text streamed to stdout as it is produced, one stats line per answer
on stderr.

Tokens go through an `IncrementalDetokenizer`, so a character whose bytes span tokens is printed whole. In chat,
a `ReasoningStream` splits the output as the server does: the reasoning goes to stderr under a `thinking:` header
(dimmed on a terminal), the answer to stdout, and only the answer joins the conversation.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from deltaspec.cli.flags import engine_config, one_value, sampling_params
from deltaspec.errors import DeltaspecError
from deltaspec.outputs import RequestOutput
from deltaspec.server.detokenizer import IncrementalDetokenizer
from deltaspec.server.reasoning import THINK_START, ReasoningStream

GENERATE_MAX_TOKENS = 64
CHAT_MAX_TOKENS = 256
DIM, RESET = "\x1b[2m", "\x1b[0m"


def load_llm(args: argparse.Namespace):
    from deltaspec.llm import LLM

    return LLM(progress=True, **engine_config(args).flat())


def stats_line(output: RequestOutput, config) -> str:
    """`[prompt tokens: N | new tokens: N | time to first token: ... | decode tok/s: ... | finish: ... | ...]`."""
    m = output.metrics
    ttft = f"{m['time_to_first_token'] * 1000:.1f} ms" if m["time_to_first_token"] is not None else "n/a"
    tok_s = f"{m['decode_tok_s']:.1f}" if m["decode_tok_s"] is not None else "n/a"
    spec = (
        f" | {config.speculation.speculative}: AL {m['acceptance_length']:.2f} over {m['spec_rounds']} rounds"
        if m.get("spec_rounds")
        else ""
    )
    return (
        f"[prompt tokens: {m['num_prompt_tokens']} | new tokens: {m['num_generated_tokens']} | "
        f"time to first token: {ttft} | decode tok/s: {tok_s} | finish: {output.outputs[0].finish_reason} | "
        f"{config.host.device} {config.load.dtype}{spec}]"
    )


def text_deltas(llm, prompt: str | dict, params, on_finish: Callable[[RequestOutput], None]) -> Iterator[str]:
    """The completion of `prompt` as printable text deltas; `on_finish` gets the finished request. The request is
    added (and checked) on the first delta, so a bad request raises before anything is printed."""
    detokenizer = IncrementalDetokenizer(llm.tokenizer, params.skip_special_tokens, params.stop)
    for step in llm.stream(prompt, params):
        if step.output is None:
            yield detokenizer.add(step.token_ids)
            continue
        yield detokenizer.finish(step.token_ids, step.output.outputs[0].text)
        on_finish(step.output)


def write(stream: TextIO, text: str) -> None:
    if text:
        stream.write(text)
        stream.flush()


def cmd_generate(args: argparse.Namespace) -> None:
    """Print the prompt, then its completion as it is generated, ending with a newline; then the stats line."""
    prompt = one_value("prompt", args.prompt_text, "--prompt", args.prompt)
    if prompt is None:
        raise DeltaspecError('generate needs a prompt: deltaspec generate "def add(a, b):" (or --prompt TEXT).')
    llm = load_llm(args)
    finished: list[RequestOutput] = []
    deltas = text_deltas(llm, prompt, sampling_params(llm, args, GENERATE_MAX_TOKENS), finished.append)
    first = next(deltas)
    write(sys.stdout, prompt)
    last = prompt[-1:]
    for delta in itertools.chain([first], deltas):
        write(sys.stdout, delta)
        last = delta[-1:] or last
    if last != "\n":
        write(sys.stdout, "\n")
    print(stats_line(finished[0], llm.engine.config), file=sys.stderr)


def started_in_thinking(prompt: str) -> bool:
    """Whether the rendered chat prompt leaves the model inside a think block (as the server decides)."""
    return prompt.rstrip().endswith(THINK_START)


def print_answer(deltas: Iterator[str], in_thinking: bool, out: TextIO, err: TextIO) -> str:
    """Print the reasoning in `deltas` on `err` under a `thinking:` header and the answer on `out` (ending with a
    newline), each as it arrives; return the answer."""
    split = ReasoningStream(in_thinking)
    dim = err.isatty()
    reasoning_open = False
    answer = ""

    def show(reasoning: str, content: str) -> None:
        nonlocal reasoning_open, answer
        if reasoning:
            write(err, "" if reasoning_open else "thinking:\n")
            write(err, f"{DIM}{reasoning}{RESET}" if dim else reasoning)
            reasoning_open = True
        if content:
            if reasoning_open:
                write(err, "\n")
                reasoning_open = False
            write(out, content)
            answer += content

    for delta in deltas:
        show(*split.feed(delta))
    show(*split.flush())
    if reasoning_open:
        write(err, "\n")
    if answer and not answer.endswith("\n"):
        write(out, "\n")
    return answer


def read_image(path: str) -> bytes:
    """The bytes of an image file the user names with --image."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise DeltaspecError(f"The image file {path} cannot be read ({exc.strerror}); check the path.") from None


def cmd_chat(args: argparse.Namespace) -> None:
    """One answer to the message (the argument or --message), or a conversation on stdin (an empty line or EOF
    ends it). The chat template's own thinking default holds unless --thinking or --no-thinking is given."""
    one_message = one_value("message", args.message_text, "--message", args.message)
    images = [{"type": "image", "image": read_image(path)} for path in args.image or []]
    llm = load_llm(args)
    if llm.tokenizer is None:
        raise DeltaspecError("This checkpoint has no tokenizer, so chat cannot render messages; use generate.")
    params = sampling_params(llm, args, CHAT_MAX_TOKENS)
    options = {} if args.thinking is None else {"enable_thinking": args.thinking}
    history = [{"role": "system", "content": args.system}] if args.system else []
    turns = [one_message] if one_message is not None else iter(lambda: input("> "), "")
    try:
        for message in turns:
            content = [*images, {"type": "text", "text": message}] if images else message
            history.append({"role": "user", "content": content})
            images = []  # the first message carries them; later turns see them in the history
            prompt = llm.chat_prompt(history, chat_template_kwargs=options)
            finished: list[RequestOutput] = []
            deltas = text_deltas(llm, prompt, params, finished.append)
            answer = print_answer(deltas, started_in_thinking(prompt["prompt"]), sys.stdout, sys.stderr)
            history.append({"role": "assistant", "content": answer})
            print(stats_line(finished[0], llm.engine.config), file=sys.stderr)
    except EOFError:
        pass
