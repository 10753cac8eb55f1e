"""Sampling: parameters, the batched sampler, logprobs."""
