"""deltaspec: inference engine for hybrid Gated DeltaNet / attention LLMs, built around speculative decoding."""

from deltaspec.errors import DeltaspecError
from deltaspec.llm import LLM
from deltaspec.outputs import CompletionOutput, RequestOutput
from deltaspec.sample.params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "DeltaspecError"]
__version__ = "0.1.0"
