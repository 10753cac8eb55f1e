"""Tests of the command line (deltaspec.cli)."""
