"""Tests of caches and the memory plan (deltaspec.cache)."""
