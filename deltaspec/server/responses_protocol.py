"""OpenAI's Responses API request (`POST /v1/responses`) and how it reads as a chat completion request.

Accepted: `input` (a string, or items: messages with text parts, `function_call`, `function_call_output` and
`reasoning` items), `instructions` (a system message first), `max_output_tokens`, `temperature`, `top_p`, function
`tools` (Responses' flat shape), `tool_choice`, `parallel_tool_calls`, `text.format` (text, json_object,
json_schema), `stream`, `metadata` (echoed), and the sampling fields of the other endpoints (`top_k`, `seed`, `stop`,
`repetition_penalty`, ... and `chat_template_kwargs`). Accepted and without effect here: `store` (nothing is
stored), `user`, `include`, `prompt_cache_key`, `safety_identifier`, `service_tier`. Refused in one sentence,
since this server cannot do what they ask: `previous_response_id` and `conversation` (no stored responses),
`background`, `prompt` (stored prompts), `reasoning` options, `max_tool_calls`, `top_logprobs`,
`truncation: "auto"`, non-function tools, input parts other than text and `input_image` (a data: URL, for a model
that reads images), and the chat spellings `n`, `best_of`,
`max_tokens` (`n_predict`) and `prompt_logprobs`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from deltaspec.server.checks import check_max_tokens
from deltaspec.server.errors import APIError, shown
from deltaspec.server.protocol import ChatCompletionRequest, SamplingFields, _Request

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
MESSAGE_ROLES = ("user", "system", "developer", "assistant")


class InputPart(_Request):
    type: str
    text: str | None = None
    image_url: str | None = None  # an input_image part's: a data: URL (or an allowed local file)
    file_id: str | None = None
    detail: str | None = None


class InputItem(_Request):
    """One `input` item; which fields it has depends on `type` (a message when it has none)."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    summary: list[InputPart] | None = None


class ResponsesTool(_Request):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(SamplingFields):
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    # refused when set (`refusals`)
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool = False
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None


def _refuse(name: str, why: str) -> APIError:
    return APIError(400, f"{name} {why}.", param=name)


def refusals(req: ResponsesRequest) -> None:
    """400 for what the request asks and this server does not do, naming what works instead."""
    stored = "needs stored responses, which this server does not keep; send the whole conversation as input"
    for name, why in (("previous_response_id", stored), ("conversation", stored), ("prompt", "is not supported")):
        if getattr(req, name) is not None:
            raise _refuse(name, why)
    if req.background:
        raise _refuse("background", "is not supported; send the request without it, or stream it")
    if req.reasoning is not None:
        raise _refuse("reasoning", "options are not supported; chat_template_kwargs.enable_thinking turns thinking on")
    if req.max_tool_calls is not None:
        raise _refuse("max_tool_calls", "is not supported; parallel_tool_calls false allows one call")
    if req.top_logprobs is not None:
        raise _refuse("top_logprobs", "is not supported here; send logprobs to /v1/chat/completions")
    if req.truncation == "auto":
        raise _refuse("truncation", '"auto" is not supported; send a conversation that fits the context')
    for name, unset in (("n", 1), ("best_of", None), ("prompt_logprobs", None)):
        if getattr(req, name) != unset:
            raise _refuse(name, "is a chat completions field; send it to /v1/chat/completions")
    if req.max_tokens is not None:
        raise _refuse("n_predict" if req.n_predict is not None else "max_tokens", "is max_output_tokens here")
    check_max_tokens(req.max_output_tokens, "max_output_tokens")


def _text(parts: str | list[InputPart] | None, where: str) -> str | None:
    """A content or output given as text or as text parts, joined."""
    if parts is None or isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts):
        if part.type not in TEXT_PARTS or part.text is None:
            raise APIError(
                400, f"{where}[{j}] is a {shown(part.type)} part, but only text parts are supported.", param=where
            )
        texts.append(part.text)
    return "\n".join(texts)


def _content(parts: str | list[InputPart] | None, where: str) -> str | list[dict] | None:
    """A message's content: text, or with `input_image` parts the chat completion's text and image_url parts."""
    if parts is None or isinstance(parts, str) or all(part.type != "input_image" for part in parts):
        return _text(parts, where)
    content = []
    for j, part in enumerate(parts):
        if part.type == "input_image":
            if part.image_url is None:
                raise APIError(
                    400,
                    f"{where}[{j}] is an input_image without image_url; this server keeps no files, so send the image "
                    "as a data: URL.",
                    param=f"{where}[{j}]",
                )
            content.append({"type": "image_url", "image_url": {"url": part.image_url}})
        elif part.type in TEXT_PARTS and part.text is not None:
            content.append({"type": "text", "text": part.text})
        else:
            raise APIError(
                400, f"{where}[{j}] is a {shown(part.type)} part; send text and input_image parts.", param=where
            )
    return content


def messages_of(req: ResponsesRequest) -> list[dict]:
    """The request's `instructions` and `input` as chat messages: function calls join the assistant turn they
    follow, their outputs become tool messages, and a reasoning item's text becomes the next assistant turn's
    `reasoning_content`."""
    messages: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    reasoning = None
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if item.type == "reasoning":
            reasoning = _text(item.content, f"{where}.content") or _text(item.summary, f"{where}.summary")
        elif item.type == "message":
            if item.role not in MESSAGE_ROLES:
                raise APIError(
                    400, f"{where} has the role {shown(item.role)}; use user, system, developer or assistant."
                )
            messages.append({"role": item.role, "content": _content(item.content, f"{where}.content") or ""})
        elif item.type == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise APIError(400, f"{where} is a function_call without call_id, name and arguments.", param=where)
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1]["tool_calls"] = [*messages[-1].get("tool_calls", []), call]
        elif item.type == "function_call_output":
            output = _text(item.output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output or ""})
        else:
            raise APIError(
                400,
                f"{where} is a {shown(item.type)} item; send message, function_call, function_call_output or "
                "reasoning items.",
                param=where,
            )
        if reasoning is not None and messages and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"], reasoning = reasoning, None
    return messages


def _tools(req: ResponsesRequest) -> list[dict] | None:
    if req.tools is None:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if tool.type != "function" or tool.name is None:
            raise APIError(
                400, f"tools[{i}] is a {shown(tool.type)} tool; this server calls only function tools.", param="tools"
            )
        function = tool.model_dump(include={"name", "description", "parameters", "strict"}, exclude_none=True)
        tools.append({"type": "function", "function": function})
    return tools


def _response_format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {key: value for key, value in schema.items() if value is not None}}


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that asks what `req` asks (after `refusals`)."""
    refusals(req)
    sampling = req.model_dump(include=set(SamplingFields.model_fields), exclude_unset=True, by_alias=True)
    sampling.pop("stream", None)
    choice = req.tool_choice
    fields = {
        **sampling,
        "messages": messages_of(req),
        "tools": _tools(req),
        "tool_choice": {"type": "function", "function": {"name": choice.name}}
        if isinstance(choice, FunctionChoice)
        else choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_tokens": req.max_output_tokens,
        "response_format": _response_format(req),
        "chat_template_kwargs": req.chat_template_kwargs,
    }
    return ChatCompletionRequest.model_validate({key: value for key, value in fields.items() if value is not None})
