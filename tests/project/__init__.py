"""Tests of the repository: structure and docs."""
