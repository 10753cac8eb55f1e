"""Tests of the engine: scheduling, failures, shutdown (deltaspec.engine)."""
