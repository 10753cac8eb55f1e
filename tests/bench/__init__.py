"""Tests of benchmarks (deltaspec.bench)."""
