"""Tests of GGUF files (deltaspec.model.gguf_*)."""
