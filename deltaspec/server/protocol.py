"""OpenAI wire format: pydantic models of the requests the server accepts and the bodies it returns.

Owns field names, types and defaults of `/v1/chat/completions`, `/v1/completions` and `/v1/models`
requests and responses (stream chunks included), plus vLLM's sampling extensions (`top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, `ignore_eos`, `best_of`, `prompt_logprobs`, ...), its chat-template fields
(`add_generation_prompt`, `continue_final_message`, `chat_template`), llama-server's spellings (`n_predict`,
`repeat_penalty`, `json_schema`: `dialects.py` reads them), structured output (`response_format`,
`structured_outputs`, `guided_*`) and deltaspec's `vote`. Requests validate
strictly: `true` is not an integer, `"3"` is not a number (an integer is a number). Unknown request
fields are ignored, as vLLM does, except those that would change what a request means (`checks.py`).
Rules that need the engine (context length, `max_n`) live in the endpoint modules, not here.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP = 64  # stop strings, and stop token ids, per request


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs` request object: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def params(self) -> dict:
        """The keyword arguments of `StructuredOutputsParams`."""
        return {
            "json": self.json_,
            "json_object": self.json_object,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
        }


class SamplingFields(_Request):
    """Fields shared by chat and completion requests (OpenAI's plus vLLM's and llama-server's extensions)."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    max_tokens: int | None = None
    n_predict: int | None = None  # llama-server's max_tokens; -1: the rest of the context
    # None: the model's generation_config.json default, else vLLM's (1, 1, 0 = off, 0, 1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    repeat_penalty: float | None = None  # llama-server's repetition_penalty
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # structured output (deltaspec.server.structured): one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    json_schema: dict[str, Any] | None = None  # llama-server's guided_json


class ImageURL(_Request):
    url: str
    detail: str | None = None  # OpenAI's resolution hint; the checkpoint's processor decides the size


class ContentPart(_Request):
    """One part of a list-valued message content: `text`, or `image_url` (a data: URL, or a file under
    --allowed-local-media-path) for a model that reads images."""

    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any]


class ToolCallParam(_Request):
    """A tool call of an earlier assistant turn, sent back in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatTemplateFields(_Request):
    """What renders a conversation into a prompt: the messages, the tools, and vLLM's template options."""

    messages: list[ChatMessage]
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    parallel_tool_calls: bool = True
    vote: bool = False
    # vLLM's, not implemented on chat: typed, and refused when true (checks.py)
    echo: bool = False
    return_token_ids: bool = False


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    vote: bool = False
    return_token_ids: bool = False  # vLLM's: each choice also carries its prompt's and its own token ids


# ---- responses ----


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs`: one candidate token of one prompt position."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # per prompt position (the first is None), token id -> entry


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class VoteInfo(BaseModel):
    """deltaspec's `vote` extension: the majority answer and how the samples went."""

    winner: str | None
    counts: dict[str, int]
    samples_finished: int
    samples_aborted: int


def _left_out_when_none(value: object) -> bool:
    return value is None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    vote: VoteInfo | None = None
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=_left_out_when_none)  # vLLM's


class DeltaMessage(BaseModel):
    """What one stream chunk adds to a choice; dumped with `exclude_unset`, so unset fields are absent."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(BaseModel):
    """`prompt_token_ids` (with `return_token_ids`) and `token_ids` (with it, or from a model without a tokenizer,
    whose `text` is empty) are left out of the body when not asked for."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_left_out_when_none)
    token_ids: list[int] | None = Field(default=None, exclude_if=_left_out_when_none)
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=_left_out_when_none)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    vote: VoteInfo | None = None


class ModelCard(BaseModel):
    """The served model; `shape` (random-weight models), `speculative` and `draft_tokens` are deltaspec's
    additions, so that a benchmark can record what the server ran."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "deltaspec"
    root: str
    max_model_len: int
    shape: str | None = None
    speculative: str = "none"
    draft_tokens: int | None = None  # None without a drafter


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
