"""`PromptImages`: what a prompt's images add to the text model, made once when the request arrives and read by every
pass over the prompt: the tower's embeddings of the image tokens, the prompt's three RoPE position streams and the
shift of the positions after it, and the ids under which the prefix cache files the image tokens (derived from each
image's bytes, so two images never share a cache entry and the same image always finds its own)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class PromptImages:
    embeds: torch.Tensor  # [image tokens, hidden] every image's embeddings in prompt order, on the model's device
    positions: torch.Tensor  # [3, prompt tokens] long: temporal, height and width positions (equal for text)
    delta: int  # a token at position n >= the prompt's length sits at n + delta on all three streams
    embed_rows: tuple[int, ...]  # per prompt token: its row of `embeds`, -1 for a text token
    cache_ids: tuple[int, ...]  # per prompt token: the id the prefix cache keys it by
    sections: tuple[int, int, int]  # the text model's M-RoPE sections (`deltaspec.ops.mrope`)
    files: tuple[bytes, ...]  # the images as the request sent them (what another rank rebuilds this from)

    @cached_property
    def _temporal(self) -> tuple[int, ...]:
        """The prompt's temporal stream as ints, read once rather than a tensor element per row."""
        return tuple(self.positions[0].tolist())

    def rope_position(self, position: int) -> int:
        """The RoPE position of token `position` on the text streams: a prompt token's temporal one (the same on
        all three streams for text), a later token's shifted by `delta`."""
        prompt = len(self.embed_rows)
        return self._temporal[position] if position < prompt else position + self.delta


def image_cache_ids(token_ids: list[int], image_token_id: int, images: list[bytes]) -> tuple[int, ...]:
    """The prompt's ids as the prefix cache keys them: text tokens as they are, the k-th token of the i-th run of
    image tokens as a negative id drawn from image i's SHA-256 and k (real ids are never negative)."""
    digests = [hashlib.sha256(data).digest() for data in images]
    out, run, k = [], -1, 0
    for i, token in enumerate(token_ids):
        if token != image_token_id:
            out.append(token)
            continue
        if i == 0 or token_ids[i - 1] != image_token_id:
            run, k = run + 1, 0
        out.append(-1 - int.from_bytes(hashlib.blake2b(digests[run] + k.to_bytes(4, "little"), digest_size=7).digest()))
        k += 1
    return tuple(out)
