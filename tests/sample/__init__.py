"""Tests of sampling and structured output (deltaspec.sample)."""
