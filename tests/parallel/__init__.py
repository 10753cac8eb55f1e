"""Tests of tensor parallelism (deltaspec.parallel)."""
