"""`LLM`: the offline Python API, shaped like vLLM's (`generate`, `chat`)."""

from __future__ import annotations

import itertools
from dataclasses import fields, replace

from tqdm import tqdm

from deltaspec.config import EngineConfig
from deltaspec.engine.engine import Engine
from deltaspec.errors import DeltaspecError
from deltaspec.execution.sequence import Sequence
from deltaspec.outputs import CompletionOutput, RequestOutput
from deltaspec.sample.params import SamplingParams
from deltaspec.spec.drafter import Drafter
from deltaspec.spec.speculator import DraftLength

PromptType = str | dict


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
        **engine_options,
    ):
        """`engine_options` are `EngineConfig` fields; `drafter` and `draft_policy` replace the drafter and the
        draft-length policy the configuration would build (see `Engine`)."""
        known = {f.name for f in fields(EngineConfig)}
        if unknown := sorted(set(engine_options) - known):
            raise DeltaspecError(
                f"Unknown LLM option(s) {', '.join(unknown)}; known options: {', '.join(sorted(known))}."
            )
        self.engine = Engine(
            EngineConfig(model=model, **engine_options), progress=progress, drafter=drafter, draft_policy=draft_policy
        )
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Complete each prompt: a string, or {"prompt_token_ids": [...]} (optionally with "prompt")."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = sampling_params or SamplingParams()
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
        if self.tokenizer is None:
            raise DeltaspecError("This checkpoint has no tokenizer, so chat() cannot render messages; use generate().")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(
                conv, tools=tools, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _add(self, prompt: PromptType, params: SamplingParams) -> list[Sequence]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise DeltaspecError("A dict prompt needs a 'prompt_token_ids' list.")
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, str):
            text, ids = prompt, self.engine.encode(prompt)
        else:
            raise DeltaspecError(
                f"A prompt is a string or a dict with 'prompt_token_ids', not {type(prompt).__name__}."
            )
        request_id = str(next(self._ids))
        samples = []
        for i in range(params.n):
            sample_params = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
            samples.append(self.engine.add_request(f"{request_id}-{i}", text, ids, sample_params))
        return samples

    def _output(self, group: list[Sequence]) -> RequestOutput:
        first = group[0]
        completions = [
            CompletionOutput(
                index=i,
                text=seq.stop_text
                if seq.stop_text is not None
                else self.engine.decode(seq.output_ids, seq.params.skip_special_tokens),
                token_ids=list(seq.output_ids),
                logprobs=seq.logprobs if seq.params.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for i, seq in enumerate(group)
        ]
        return RequestOutput(
            request_id=first.request_id.rsplit("-", 1)[0],
            prompt=first.prompt,
            prompt_token_ids=first.prompt_ids,
            outputs=completions,
            prompt_logprobs=first.prompt_logprobs if first.params.prompt_logprobs is not None else None,
            num_cached_tokens=first.num_cached_tokens,
            finished=all(s.finished for s in group),
            metrics=first.metrics(),
        )
