"""deltaspec: inference engine for hybrid Gated DeltaNet / attention LLMs, built around speculative decoding.

Importing it before torch makes OpenMP's threads sleep between parallel regions (OMP_WAIT_POLICY=PASSIVE, unless
the environment says otherwise): spinning threads collapse CPU decode when other processes share the cores
(docs/configuration.md, benchmarks/threads-cpu-default-model.json)."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from deltaspec.errors import DeltaspecError
from deltaspec.llm import LLM
from deltaspec.outputs import CompletionOutput, RequestOutput
from deltaspec.sample.params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "DeltaspecError"]
__version__ = "0.1.0"
