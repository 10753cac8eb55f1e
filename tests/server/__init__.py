"""Tests of the server (deltaspec.server)."""
