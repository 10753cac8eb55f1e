"""Benchmarks: scenarios, metrics (DESIGN §6) and JSON reports."""
