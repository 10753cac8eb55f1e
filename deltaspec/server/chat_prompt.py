"""A conversation -> the prompt the model reads: OpenAI messages and tools through the chat template.

Owns turning messages and tools into the template's input (`tool_choice` "none" passes no tools, a named choice
passes only that tool; text parts joined, image_url parts kept where the template puts their placeholders and their
images encoded (`deltaspec.engine.images`), `developer` read as `system`, a history call's JSON arguments parsed as
templates expect), which `chat_template_kwargs` the template may get (not the renderer's own globals nor what a
request field says), and vLLM's template options:

- `add_generation_prompt` (default true): end the prompt with the opening of the assistant's reply;
- `continue_final_message`: render without it and cut the text right after the last message's content, so the
  model continues that message (a prefilled reply), as transformers and vLLM do; it needs
  `add_generation_prompt: false`, as in vLLM;
- `chat_template`: a Jinja template for this request only, in place of the model's; as in vLLM, only when the
  server trusts request templates (`--trust-request-chat-template`), since a template is code the server runs.

Used by chat completions, `/v1/responses` and `/tokenize`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from deltaspec.errors import DeltaspecError
from deltaspec.model.tokenizer import Tokenizer
from deltaspec.model.vision.prompt import PromptImages
from deltaspec.model.vision.sources import image_bytes
from deltaspec.server.context import ServerContext
from deltaspec.server.errors import APIError, shown
from deltaspec.server.protocol import ChatMessage, ChatTemplateFields, ImageURL, NamedToolChoice

# What a request field says, which chat_template_kwargs must not say instead.
_REQUEST_FIELDS = ("messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template")
# What the template's renderer provides itself: its helpers, the special tokens and Jinja's own globals.
_TEMPLATE_GLOBALS = (
    "raise_exception",
    "strftime_now",
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
    "range",
    "dict",
    "lipsum",
    "cycler",
    "joiner",
    "namespace",
)


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: the tokenizer that rendered it (the request's template, when it gave one)."""

    tokenizer: Tokenizer
    text: str
    token_ids: list[int]
    tools: list[dict] | None  # None: no tools (none given, or tool_choice "none")
    history_len: int  # prompt tokens the next turn will share
    images: PromptImages | None = None  # the images of its image_url parts, encoded by the vision tower

    @property
    def thinking(self) -> bool:
        """Whether the reply starts inside a think block (the prompt ends with `<think>`)."""
        return self.text.rstrip().endswith("<think>")


def _content(message_index: int, content: list) -> tuple[str | list[dict], list]:
    """A list-valued content as the template takes it (text parts joined; with images, a list of text and image
    parts, each image where the template puts its placeholder) and the images' sources, in order."""
    parts, images = [], []
    for j, part in enumerate(content):
        where = f"messages[{message_index}].content[{j}]"
        if part.type == "image_url":
            url = part.image_url.url if isinstance(part.image_url, ImageURL) else part.image_url
            if not url:
                raise APIError(400, f"{where} is an image_url part without a URL; add it.", param=f"{where}.image_url")
            parts.append({"type": "image"})
            images.append((url, f"{where}.image_url"))
            continue
        if part.type != "text":
            raise APIError(
                400,
                f"{where} is a {shown(part.type)} part, but only text and image_url parts are supported.",
                param=f"messages[{message_index}].content",
            )
        if part.text is None:
            raise APIError(400, f"{where} is a text part without 'text'; add its text.", param=f"{where}.text")
        parts.append({"type": "text", "text": part.text})
    if not images:
        return "\n".join(part["text"] for part in parts), []
    return parts, images


def _tool_call_for_template(call: dict) -> dict:
    """A history tool call with JSON-object arguments parsed into a dict, as templates expect (vLLM does this)."""
    arguments = call["function"]["arguments"]
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            call = {**call, "function": {**call["function"], "arguments": parsed}}
    return call


def template_messages(messages: list[ChatMessage]) -> tuple[list[dict], list[tuple[str, str]]]:
    """OpenAI messages as chat-template dicts (text parts joined, `developer` read as `system`) and the sources of
    their images in order, each with the request field it came from."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.content
        if content is None and message.role != "assistant":
            raise APIError(
                400, f"messages[{i}] ({shown(message.role)}) needs a content.", param=f"messages[{i}].content"
            )
        if isinstance(content, list):
            content, found = _content(i, content)
            images += found
        item: dict = {"role": "system" if message.role == "developer" else message.role, "content": content}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(message, key) is not None:
                item[key] = getattr(message, key)
        if message.tool_calls:
            item["tool_calls"] = [_tool_call_for_template(c.model_dump(exclude_none=True)) for c in message.tool_calls]
        out.append(item)
    return out, images


def template_tools(req: ChatTemplateFields) -> list[dict] | None:
    """The tools given to the template (and parsed from the output), or None for no tools."""
    choice = req.tool_choice
    if not req.tools:
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise APIError(400, "tool_choice asks for a tool call but the request has no tools.", param="tool_choice")
        return None
    if choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not tools:
            raise APIError(
                400,
                f"tool_choice names the function {shown(choice.function.name)}, "
                "which is not among the request's tools.",
                param="tool_choice",
            )
    return tools


def check_template_fields(req: ChatTemplateFields, trusts_templates: bool) -> None:
    """The rules a conversation's template options must meet; every problem is an APIError."""
    if not req.messages:
        raise APIError(400, "messages must contain at least one message.", param="messages")
    for key in req.chat_template_kwargs or {}:
        if key in _REQUEST_FIELDS:
            raise APIError(
                400,
                f"chat_template_kwargs cannot set '{key}'; use the request field instead.",
                param=f"chat_template_kwargs.{key}",
            )
        if key in _TEMPLATE_GLOBALS:
            raise APIError(
                400,
                f"chat_template_kwargs cannot set '{key}', which the chat template's renderer reserves; remove it.",
                param=f"chat_template_kwargs.{key}",
            )
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message continues the last message instead of opening a reply; send it with "
            "add_generation_prompt false.",
            param="continue_final_message",
        )
    if req.chat_template is not None and not trusts_templates:
        raise APIError(
            400,
            "This server runs no chat template sent with a request; start it with --trust-request-chat-template, "
            "or send the request without chat_template.",
            param="chat_template",
        )


def _template_tokenizer(tokenizer: Tokenizer, template: str | None) -> Tokenizer:
    """The tokenizer that renders with the request's `chat_template`, or `tokenizer` itself without one."""
    if template is None:
        return tokenizer
    try:
        return tokenizer.with_chat_template(template)
    except DeltaspecError:
        raise APIError(
            400, "chat_template is not a valid Jinja template; fix its syntax or leave it out.", param="chat_template"
        ) from None


def continued(rendered: str, final: str | None) -> str:
    """`rendered` cut right after the last message's text `final` (transformers' `continue_final_message`)."""
    if not final or final.strip() not in rendered:
        raise APIError(
            400,
            "continue_final_message needs a last message whose text the chat template keeps as it is; give the "
            "last message the text to continue, or send the request without continue_final_message.",
            param="continue_final_message",
        )
    at = rendered.rindex(final.strip())
    if rendered[at : at + len(final.lstrip())] == final:  # the template kept the message's trailing whitespace
        return rendered[: at + len(final.lstrip())]
    return rendered[: at + len(final.strip())]


def render_chat(ctx: ServerContext, req: ChatTemplateFields, add_special_tokens: bool = False) -> ChatPrompt:
    """Check the request's template options, render its conversation and tokenize it; every problem is an APIError.

    Rendering and tokenizing a long conversation takes a while: callers run this on a worker thread.
    """
    check_template_fields(req, ctx.trusts_request_templates)
    tokenizer = _template_tokenizer(ctx.require_tokenizer("chat messages cannot be rendered"), req.chat_template)
    tools = template_tools(req)
    (messages, sources), options = template_messages(req.messages), req.chat_template_kwargs or {}
    try:
        ctx.engine.engine.images.check(len(sources))
    except DeltaspecError as exc:
        raise APIError(400, str(exc), param="messages") from None
    files = image_files(ctx, sources)
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=req.add_generation_prompt, **options
        )
        if req.continue_final_message:
            final = messages[-1]["content"]
            text = continued(text, final if not isinstance(final, list) else "".join(p.get("text", "") for p in final))
        token_ids = ctx.encode_prompt(tokenizer, text, add_special_tokens)
        history_len = tokenizer.history_length(token_ids, messages, tools=tools, **options)
        token_ids, images, history_len = ctx.engine.engine.images.prompt(token_ids, files, history_len)
    except DeltaspecError as exc:
        raise APIError(400, str(exc)) from None
    return ChatPrompt(tokenizer, text, token_ids, tools, history_len, images)


def image_files(ctx: ServerContext, sources: list[tuple[str, str]]) -> tuple[bytes, ...]:
    """The encoded images of the request's image_url parts (data: URLs; files only under the allowed local media
    path; never the network); each problem is a 400 naming its part."""
    files = []
    for url, param in sources:
        try:
            files.append(image_bytes(url, ctx.engine.engine.config.load.allowed_local_media_path))
        except DeltaspecError as exc:
            raise APIError(400, str(exc), param=param) from None
    return tuple(files)
