"""Tests of the offline LLM API and evaluation (deltaspec.llm, deltaspec.evaluate_kl)."""
