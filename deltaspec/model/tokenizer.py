"""Text <-> token ids and chat-template rendering for a checkpoint directory.

Owns loading `tokenizer.json` (through the `tokenizers` library, never `transformers`), the special tokens and
end-of-sequence ids named by `tokenizer_config.json` and `generation_config.json`, and rendering the model's Jinja
chat template exactly as Hugging Face `apply_chat_template(..., tokenize=False)` does.
"""

import copy
import functools
import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from deltaspec.errors import DeltaspecError

REPLY_PLACEHOLDER = "\u2063"  # an assistant reply's stand-in when rendering the next turn (INVISIBLE SEPARATOR)

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _read_json(path: Path) -> Any:
    """Parse a JSON file, or return None when it does not exist."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DeltaspecError(f"{path} is not valid JSON ({exc}); restore it from the original checkpoint.") from exc


def _token_content(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json as text: a plain string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    """`raise_exception` for templates: the template refuses the conversation with its own message."""
    raise DeltaspecError(f"The chat template refused these messages: {str(message).rstrip('.')}.")


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """Hugging Face's `tojson` filter: plain `json.dumps`, without Jinja's HTML escaping."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    """`strftime_now` for templates: the current local time formatted with `format`."""
    return datetime.now().strftime(format)


def _template_message(message: Any) -> dict:
    """A message as Hugging Face hands it to the template: None-valued keys dropped, reasoning aliased.

    Reasoning passed as `thinking` or `reasoning` is also exposed as `reasoning_content` (which templates read),
    and `reasoning_content` is also exposed as `thinking`.
    """
    if not isinstance(message, Mapping):
        raise DeltaspecError(f"Chat messages must be dicts with 'role' and 'content', but got {message!r}.")
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


class Tokenizer:
    """A checkpoint's tokenizer: encoding, decoding, end-of-sequence ids and the chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        source: str,
        special_tokens: dict[str, str],
        eos_token_ids: frozenset[int],
        chat_templates: dict[str, str],
    ) -> None:
        """Wrap a loaded `tokenizers.Tokenizer`; use `Tokenizer.from_dir` to load one from a checkpoint."""
        self._backend = backend
        self._source = source
        self._special_tokens = special_tokens
        self._eos_token_ids = eos_token_ids
        self._chat_templates = chat_templates
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer | None":
        """Load the tokenizer of the checkpoint at `path`, or return None when it has no `tokenizer.json`.

        Reads `tokenizer_config.json` (special tokens, added tokens, chat template), `chat_template.jinja` and
        `additional_chat_templates/*.jinja` (which replace the config's templates, as in transformers), and
        `generation_config.json` (`eos_token_id`), each only when present.
        """
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            return None
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise DeltaspecError(
                f"{tokenizer_file} could not be read as a tokenizer ({exc}); restore it from the original checkpoint."
            ) from exc

        config = _read_json(path / "tokenizer_config.json") or {}
        for _, entry in sorted((config.get("added_tokens_decoder") or {}).items(), key=lambda e: int(e[0])):
            content = _token_content(entry)
            if content is not None and backend.token_to_id(content) is None:
                added = tokenizers.AddedToken(content, special=bool(entry.get("special", True)), normalized=False)
                if added.special:
                    backend.add_special_tokens([added])
                else:
                    backend.add_tokens([added])
        special_tokens = {
            key: content for key in _SPECIAL_TOKEN_KEYS if (content := _token_content(config.get(key))) is not None
        }

        eos_token_ids: set[int] = set()
        generation_eos = (_read_json(path / "generation_config.json") or {}).get("eos_token_id")
        if isinstance(generation_eos, int):
            eos_token_ids.add(generation_eos)
        elif isinstance(generation_eos, list):
            eos_token_ids.update(i for i in generation_eos if isinstance(i, int))
        if "eos_token" in special_tokens and (eos_id := backend.token_to_id(special_tokens["eos_token"])) is not None:
            eos_token_ids.add(eos_id)

        return cls(
            backend,
            source=str(path),
            special_tokens=special_tokens,
            eos_token_ids=frozenset(eos_token_ids),
            chat_templates=cls._read_chat_templates(path, config),
        )

    @staticmethod
    def _read_chat_templates(path: Path, config: Mapping[str, Any]) -> dict[str, str]:
        """Named chat templates: from `.jinja` files when any exist, else from tokenizer_config.json."""
        templates = {}
        if (path / "chat_template.jinja").is_file():
            templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
        for template_file in sorted((path / "additional_chat_templates").glob("*.jinja")):
            templates[template_file.stem] = template_file.read_text(encoding="utf-8")
        if templates:
            return templates
        configured = config.get("chat_template")
        if isinstance(configured, str):
            return {"default": configured}
        if isinstance(configured, list):
            return {entry["name"]: entry["template"] for entry in configured}
        return {}

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: generation_config's `eos_token_id` plus tokenizer_config's `eos_token`."""
        return self._eos_token_ids

    @property
    def has_chat_template(self) -> bool:
        """Whether the checkpoint ships a chat template."""
        return bool(self._chat_templates)

    def chat_templates(self) -> list[str]:
        """The checkpoint's chat template texts (the default one and any named ones)."""
        return list(self._chat_templates.values())

    def with_chat_template(self, template: str) -> "Tokenizer":
        """This tokenizer with `template` as its only chat template, in place of the checkpoint's (vLLM's and
        llama-server's --chat-template); a template that is not valid Jinja is refused here, before any request."""
        replaced = copy.copy(self)
        replaced._chat_templates = {"default": template}
        replaced._compiled = {}
        try:
            replaced._compile(template)
        except DeltaspecError as exc:
            syntax = exc.__cause__
            raise DeltaspecError(
                f"The --chat-template is not valid Jinja (line {syntax.lineno}: {syntax.message})."
            ) from None
        return replaced

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer as tokenizer.json text (for llguidance's tokenizer)."""
        return self._backend.to_str()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text are encoded as single ids. Goes through the
        batch entry point of `tokenizers`, which releases the GIL while it runs (plain `encode` holds it), so a
        long text tokenizing on a worker thread leaves the server's event loop free."""
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound of the bytes of text one token stands for: the longest vocabulary entry in UTF-8 (a
        byte-level BPE entry writes each byte as one character of one or two bytes), so a text of n bytes is at
        least n / max_token_bytes tokens."""
        return max(len(token.encode("utf-8", "surrogatepass")) for token in self._backend.get_vocab(True))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; `skip_special_tokens` drops special tokens such as `<|im_end|>` (not `<think>`)."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int) -> str:
        """Text of one token, special tokens included (a partial UTF-8 character decodes to U+FFFD)."""
        return self._backend.decode([int(token_id)], skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry for `token_id`, or None when the id is out of range."""
        return self._backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary entry `token`, or None when there is none."""
        return self._backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` (and `tools`) with the chat template, as Hugging Face `apply_chat_template` does.

        The template sees `messages`, `tools`, `documents` (None), `add_generation_prompt`, the special tokens
        named in tokenizer_config.json (`bos_token`, `eos_token`, ...) and `template_kwargs` (e.g.
        `enable_thinking`), which override the special tokens.
        """
        template = self._compile(self._select_template(tools))
        if not messages:
            raise DeltaspecError("Cannot apply the chat template to an empty conversation; pass at least one message.")
        context = {
            "documents": None,
            **self._special_tokens,
            **template_kwargs,
            "messages": [_template_message(message) for message in messages],
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return template.render(**context)
        except (jinja2.TemplateError, TypeError) as exc:
            raise DeltaspecError(
                f"The chat template of the model at {self._source} could not render these messages ({exc}); "
                "check that every message has the fields the template reads."
            ) from exc

    def history_length(
        self, prompt_ids: list[int], messages: list[dict], *, tools: list[dict] | None = None, **template_kwargs: Any
    ) -> int:
        """How many of `prompt_ids` (`messages` rendered with the generation prompt) the next turn's prompt will start
        with: the tokens they share with the conversation rendered as the next turn renders it, with this turn's
        reply as an assistant message (a placeholder). Templates rewrite an earlier turn — Qwen3.5's drops the empty
        `<think></think>` block its generation prompt opens the reply with — so the next prompt parts from this one
        where the reply's own markup begins, not at this prompt's end."""
        follow_up = [*messages, {"role": "assistant", "content": REPLY_PLACEHOLDER}]
        try:
            text = self.apply_chat_template(follow_up, tools=tools, add_generation_prompt=False, **template_kwargs)
        except DeltaspecError:  # a template that refuses such a conversation: no checkpoint for the next turn
            return 0
        rendered = self.encode(text)
        parted = (i for i, (a, b) in enumerate(zip(prompt_ids, rendered)) if a != b)
        return next(parted, min(len(prompt_ids), len(rendered)))

    def _select_template(self, tools: list[dict] | None) -> str:
        """The template to use: `tool_use` when tools are given and one exists, else `default`."""
        if not self._chat_templates:
            raise DeltaspecError(
                f"The model at {self._source} has no chat template; use generate() with a plain prompt, "
                "or add a chat_template to tokenizer_config.json."
            )
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" not in self._chat_templates:
            raise DeltaspecError(
                f"The model at {self._source} has several chat templates ({', '.join(sorted(self._chat_templates))}) "
                "and none is named 'default'; add a chat_template.jinja with the one to use."
            )
        return self._chat_templates["default"]

    def _compile(self, source: str) -> jinja2.Template:
        """Compile a template in Hugging Face's sandboxed environment, once per template."""
        if source not in self._compiled:
            environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            environment.filters["tojson"] = _tojson
            environment.globals["raise_exception"] = _raise_exception
            environment.globals["strftime_now"] = _strftime_now
            try:
                self._compiled[source] = environment.from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                raise DeltaspecError(
                    f"The chat template of the model at {self._source} is not valid Jinja (line {exc.lineno}: "
                    f"{exc.message})."
                ) from exc
        return self._compiled[source]


class BorrowedTokenizer(Tokenizer):
    """Another model's tokenizer lent to a random-weight model with a larger vocabulary: encoding is unchanged,
    and an id beyond the lent vocabulary decodes as that id modulo its size, so every generated token shows as
    text (streamed text and its timing behave as with a real model; the text itself is meaningless)."""

    @classmethod
    def lend(cls, lent: Tokenizer) -> "BorrowedTokenizer":
        return cls(
            lent._backend,
            source=lent._source,
            special_tokens=lent._special_tokens,
            eos_token_ids=lent._eos_token_ids,
            chat_templates=lent._chat_templates,
        )

    def _fold(self, token_id: int) -> int:
        return int(token_id) % self.vocab_size

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return super().decode([self._fold(i) for i in ids], skip_special_tokens)

    def decode_token(self, token_id: int) -> str:
        return super().decode_token(self._fold(token_id))

    def id_to_token(self, token_id: int) -> str | None:
        return super().id_to_token(self._fold(token_id))
