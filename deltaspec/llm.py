"""`LLM`: the offline Python API, shaped like vLLM's (`generate`, `chat`), plus `stream` for one prompt's tokens as
they come."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

from tqdm import tqdm

from deltaspec.config.engine import SETTING_GROUP, EngineConfig
from deltaspec.engine.engine import Engine
from deltaspec.errors import DeltaspecError
from deltaspec.execution.sequence import Sequence
from deltaspec.model.vision.sources import image_bytes, message_images
from deltaspec.outputs import CompletionOutput, RequestOutput
from deltaspec.sample.params import SamplingParams
from deltaspec.spec.drafter import Drafter
from deltaspec.spec.speculative_config import speculative_fields
from deltaspec.spec.speculator import DraftLength

PromptType = str | dict
PROMPT_KEYS = ("prompt", "prompt_token_ids", "history_len", "multi_modal_data")  # vLLM's TextPrompt / TokensPrompt


@dataclass
class StreamStep:
    """What one engine step added to a request that `LLM.stream` follows."""

    token_ids: list[int]  # the tokens this step appended
    output: RequestOutput | None = None  # on the last step only: the finished request, as generate() returns it


class LLM:
    """Load a model once, then run batches of prompts through it.

    >>> llm = LLM(model="path/or/hub-id", dtype="float32", device="cpu")
    >>> llm.generate(["def add(a, b):"], SamplingParams(max_tokens=32, temperature=0.0))
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        progress: bool = False,
        drafter: Drafter | None = None,
        draft_policy: DraftLength | None = None,
        speculative_config: dict | None = None,
        **engine_options,
    ):
        """`engine_options` are `EngineConfig` fields; `speculative_config` is vLLM's dict (method,
        num_speculative_tokens, model, prompt_lookup_min / prompt_lookup_max), the same as the `speculative`,
        `draft_tokens`, `draft_model` and `prompt_lookup_*` options; `drafter` and `draft_policy` replace the drafter
        and the draft-length policy the configuration would build (see `Engine`)."""
        known = set(SETTING_GROUP)
        if unknown := sorted(set(engine_options) - known):
            raise DeltaspecError(
                f"Unknown LLM option(s) {', '.join(unknown)}; known options: {', '.join(sorted(known))}."
            )
        if speculative_config is not None:
            if not isinstance(speculative_config, dict):
                raise DeltaspecError(
                    f"speculative_config is a dict such as {{'method': 'ngram', 'num_speculative_tokens': 3}}, not "
                    f"{type(speculative_config).__name__}."
                )
            engine_options |= speculative_fields(speculative_config, engine_options, "speculative_config")
        self.engine = Engine(
            EngineConfig.from_flat(model=model, **engine_options),
            progress=progress,
            drafter=drafter,
            draft_policy=draft_policy,
        )
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers (nothing to do on one device; they also stop at exit)."""
        self.engine.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """`SamplingParams` with the model's own defaults (its `generation_config.json`: temperature, top_p, top_k,
        min_p, repetition_penalty, max_new_tokens; greedy where it says `do_sample: false`) over vLLM's."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Complete each prompt: a string, {"prompt": text} (vLLM's TextPrompt), or {"prompt_token_ids": [...]}
        (optionally with "prompt", and "history_len": the prompt tokens a follow-up will share, kept as a prefix
        checkpoint; see `chat_prompt`); a dict may carry {"multi_modal_data": {"image": images}} for the image
        tokens of a multimodal checkpoint's prompt (Pillow images, encoded bytes, data: URLs; see `docs/vision.md`)."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = sampling_params or self.get_default_sampling_params()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise DeltaspecError(
                f"Got {len(per_prompt)} sampling params for {len(prompts)} prompts; give one or one each."
            )
        groups = [self._add(prompt, p) for prompt, p in zip(prompts, per_prompt)]
        bar = tqdm(total=sum(len(g) for g in groups), desc="Generating", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished():
                bar.update(sum(seq.finished for seq in self.engine.step()))
        except BaseException:
            for group in groups:
                for seq in group:
                    if not seq.finished:
                        self.engine.abort(seq)
            raise
        finally:
            bar.close()
        return [self._output(group) for group in groups]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and complete it."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.chat_prompt(conv, tools, chat_template_kwargs, add_generation_prompt) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
    ) -> dict:
        """One conversation as a prompt for `generate` or `stream`: its rendered text, token ids and `history_len`,
        the tokens of its history (without the generation prompt), where a prefix checkpoint lets the next turn
        resume; and the images of its content parts (`deltaspec.model.vision.sources`) as `multi_modal_data`."""
        if self.tokenizer is None:
            raise DeltaspecError("This checkpoint has no tokenizer, so chat() cannot render messages; use generate().")
        options = chat_template_kwargs or {}
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **options
        )
        ids = self.engine.encode(text)
        history = self.tokenizer.history_length(ids, messages, tools=tools, **options)
        images = message_images(messages, self.engine.config.load.allowed_local_media_path)
        prompt = {"prompt": text, "prompt_token_ids": ids, "history_len": history}
        return prompt | {"multi_modal_data": {"image": images}} if images else prompt

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[StreamStep]:
        """Complete one prompt (as `generate` takes it), yielding each engine step's new tokens as they are produced;
        the last step carries the finished `RequestOutput`. A consumer that stops early aborts the request."""
        params = sampling_params or self.get_default_sampling_params()
        if params.n != 1:
            raise DeltaspecError(f"stream() follows one sample, got n={params.n}; use n=1, or generate() for several.")
        (seq,) = self._add(prompt, params)
        sent = 0
        try:
            while not seq.finished:
                self.engine.step()
                if len(seq.output_ids) > sent or seq.finished:
                    new, sent = seq.output_ids[sent:], len(seq.output_ids)
                    yield StreamStep(new, self._output([seq]) if seq.finished else None)
        finally:
            self.engine.abort(seq)

    def _prompt(self, prompt: PromptType) -> tuple[str | None, list[int], int, tuple[bytes, ...]]:
        """A prompt's text (None for bare token ids), token ids, the tokens a follow-up will share, and its images."""
        if isinstance(prompt, str):
            return prompt, self.engine.encode(prompt), 0, ()
        if not isinstance(prompt, dict):
            raise DeltaspecError(f"A prompt is a string or a dict, not {type(prompt).__name__}.")
        if unknown := sorted(set(prompt) - set(PROMPT_KEYS)):
            raise DeltaspecError(
                f"A dict prompt has unknown key(s) {', '.join(unknown)}; deltaspec reads {', '.join(PROMPT_KEYS)}."
            )
        images = self._images(prompt.get("multi_modal_data") or {})
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"]), prompt.get("history_len", 0), images
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.engine.encode(prompt["prompt"]), prompt.get("history_len", 0), images
        raise DeltaspecError("A dict prompt needs a 'prompt' string or a 'prompt_token_ids' list.")

    def _images(self, data: dict) -> tuple[bytes, ...]:
        """The images of a prompt's `multi_modal_data` ({"image": one or a list}, as vLLM takes them)."""
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise DeltaspecError(
                'multi_modal_data takes {"image": an image or a list of them}; images are all it reads.'
            )
        found = data.get("image", [])
        found = found if isinstance(found, (list, tuple)) else [found]
        return tuple(image_bytes(item, self.engine.config.load.allowed_local_media_path) for item in found)

    def _add(self, prompt: PromptType, params: SamplingParams) -> list[Sequence]:
        text, ids, history_len, images = self._prompt(prompt)
        request_id = str(next(self._ids))
        samples = []
        for i in range(params.n):
            sample_params = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
            samples.append(
                self.engine.add_request(f"{request_id}-{i}", text, ids, sample_params, history_len, images=images)
            )
        return samples

    def _output(self, group: list[Sequence]) -> RequestOutput:
        first = group[0]
        completions = [
            CompletionOutput(
                index=i,
                text=seq.stop_text
                if seq.stop_text is not None
                else self.engine.decode(seq.output_ids, seq.request.params.skip_special_tokens),
                token_ids=list(seq.output_ids),
                logprobs=seq.logprobs if seq.request.params.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for i, seq in enumerate(group)
        ]
        return RequestOutput(
            request_id=first.request.request_id.rsplit("-", 1)[0],
            prompt=first.request.prompt,
            prompt_token_ids=first.request.prompt_ids,
            outputs=completions,
            prompt_logprobs=first.prompt_logprobs if first.request.params.prompt_logprobs is not None else None,
            num_cached_tokens=first.cache.num_cached_tokens,
            finished=all(s.finished for s in group),
            metrics=first.metrics(),
        )
