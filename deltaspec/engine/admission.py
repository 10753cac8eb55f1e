"""The checks a request passes before it becomes a sequence; each failure is one sentence for the user."""

from deltaspec.errors import DeltaspecError
from deltaspec.sample.params import SamplingParams, check_token_ids


def check_request(prompt_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int) -> None:
    """A prompt must have a token, fit the context with its `max_tokens`, and use ids of the vocabulary; the
    sampling parameters that name tokens (top_k, stop_token_ids) must fit the vocabulary too."""
    check_token_ids(vocab_size, params.top_k, params.stop_token_ids)
    max_tokens = params.max_tokens
    if not prompt_ids:
        raise DeltaspecError("The prompt is empty; give at least one token.")
    if len(prompt_ids) + max_tokens > max_model_len:
        raise DeltaspecError(
            f"The prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
            f"context of {max_model_len} tokens; shorten the prompt, lower max_tokens, or raise "
            "--max-model-len."
        )
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise DeltaspecError(f"Prompt token ids must lie in [0, {vocab_size}); got one outside it.")
