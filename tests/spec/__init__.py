"""Tests of speculative decoding (deltaspec.spec)."""
