"""The Responses API's output: the Response object and its items, shared by whole and streamed replies.

Owns the items in the order a reply makes them (a `reasoning` item for the think block, a `message` with one
`output_text` part, a `function_call` per tool call), `status` ("incomplete" with `incomplete_details.reason`
"max_output_tokens" when the token limit cut the reply), `usage` (input, cached, output and reasoning tokens), and
the request's settings echoed back.
"""

from __future__ import annotations

import uuid

from deltaspec.server.chat import ChatPlan
from deltaspec.server.context import ServerContext
from deltaspec.server.protocol import ChatChoice, UsageInfo
from deltaspec.server.responses_protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [text_part(text)] if text is not None else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(choice: ChatChoice) -> list[dict]:
    """A chat choice's assistant message as Responses output items."""
    message = choice.message
    items = [reasoning_item(new_id("rs"), message.reasoning_content)] if message.reasoning_content else []
    if message.content:
        items.append(message_item(new_id("msg"), message.content))
    for call in message.tool_calls:
        items.append(call_item(new_id("fc"), call.id, call.function.name, call.function.arguments))
    return items


def response_usage(usage: UsageInfo, reasoning_tokens: int) -> dict:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def reasoning_tokens(plan: ChatPlan, output: list[dict]) -> int:
    """How many output tokens the reply's reasoning text takes."""
    texts = [part["text"] for item in output if item["type"] == "reasoning" for part in item["content"]]
    return sum(len(plan.prompt.tokenizer.encode(text)) for text in texts)


def response_object(
    ctx: ServerContext,
    req: ResponsesRequest,
    plan: ChatPlan,
    response_id: str,
    created: float,
    status: str,
    output: list[dict],
    usage: dict | None,
) -> dict:
    """The Response object, its settings echoed from the request and the chat plan's sampling parameters."""
    params = plan.params
    tool_choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
    text_format = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": ctx.model_name,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "temperature": params.temperature,
        "text": {"format": text_format or {"type": "text"}},
        "tool_choice": tool_choice or "auto",
        "tools": [tool.model_dump(exclude_none=True) for tool in req.tools or []],
        "top_p": params.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"
