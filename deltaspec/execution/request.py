"""`Request`: the part of a sequence that says what was asked and how its tokens are drawn — the prompt (its
text, ids and images), the sampling parameters with their seed and generator, the end-of-sequence ids and the
structured-output constraint's state. It is fixed when the engine admits the request; only the generator and the
constraint's state advance as tokens are committed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaspec.model.vision.prompt import PromptImages
from deltaspec.sample.params import SamplingParams
from deltaspec.sample.structured import GrammarState


@dataclass(frozen=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: frozenset[int]
    generator: torch.Generator | None = None
    seed: int | None = None  # the seed `generator` was made from
    grammar: GrammarState | None = None  # where the output stands in its structured_outputs constraint
    images: PromptImages | None = None  # the prompt's images: their embeddings, positions and cache ids
    history_len: int = 0  # prompt tokens a follow-up will share: a chat's history without its generation prompt
