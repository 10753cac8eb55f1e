"""Tests of ops, kernels and quantized products (deltaspec.ops)."""
