"""Tests of checkpoints, loading and the model (deltaspec.model)."""
