"""vLLM's `/tokenize`, `/detokenize` and `/version`, and llama-server's spellings of the first two.

- `POST /tokenize` `{"prompt", "add_special_tokens": true}` or `{"messages", ...}` (rendered as chat completions
  render them: tools, `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`; special tokens
  not added by default) -> `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` with
  `return_token_strs`); llama-server's `{"content", "add_special", "with_pieces"}` -> `{"tokens"}` (with pieces:
  `[{"id", "piece"}]`).
- `POST /detokenize` `{"tokens"}` -> `{"prompt"}` (vLLM) and `{"content"}` (llama-server): the same text under
  both tools' names.
- `GET /version` -> `{"version"}`.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import version

from deltaspec.server.chat_prompt import render_chat
from deltaspec.server.context import ServerContext
from deltaspec.server.errors import APIError
from deltaspec.server.protocol import ChatMessage, ChatTemplateFields, _Request


class TokenizeRequest(ChatTemplateFields):
    """A text (vLLM's `prompt`, llama-server's `content`) or a conversation (`messages` and its template fields)."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM's; default: true for a prompt, false for messages
    add_special: bool = False  # llama-server's
    return_token_strs: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


def server_version() -> dict:
    """vLLM's `/version` body: the installed deltaspec's version."""
    return {"version": version("deltaspec")}


def _tokenize(ctx: ServerContext, req: TokenizeRequest) -> dict:
    given = [name for name in ("prompt", "content", "messages") if getattr(req, name) is not None]
    if len(given) != 1:
        raise APIError(
            400,
            "Send exactly one of prompt, messages (vLLM's) or content (llama-server's) to tokenize.",
            param="prompt",
        )
    tokenizer = ctx.require_tokenizer("text cannot be tokenized")
    if req.content is not None:
        ids = ctx.encode_prompt(tokenizer, req.content, req.add_special)
        if req.with_pieces:
            return {"tokens": [{"id": i, "piece": tokenizer.decode_token(i)} for i in ids]}
        return {"tokens": ids}
    if req.messages is not None:
        ids = render_chat(ctx, req, bool(req.add_special_tokens)).token_ids
    else:
        add_special = req.add_special_tokens is None or req.add_special_tokens
        ids = ctx.encode_prompt(tokenizer, req.prompt, add_special)
    strs = [tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}


async def tokenize(ctx: ServerContext, req: TokenizeRequest) -> dict:
    """The body of a `/tokenize` answer (tokenized on a worker thread)."""
    ctx.check_model(req.model)
    return await asyncio.to_thread(_tokenize, ctx, req)


async def detokenize(ctx: ServerContext, req: DetokenizeRequest) -> dict:
    """The body of a `/detokenize` answer: the tokens' text under vLLM's name and llama-server's."""
    ctx.check_model(req.model)
    tokenizer = ctx.require_tokenizer("token ids cannot be decoded")
    vocab = ctx.engine.engine.model_config.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(
            400, f"Token id {bad} is outside the vocabulary; send ids from 0 to {vocab - 1}.", param="tokens"
        )
    text = await asyncio.to_thread(tokenizer.decode, req.tokens, False)
    return {"prompt": text, "content": text}
