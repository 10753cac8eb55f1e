"""Ops: one module per op family, each a torch reference; `dispatch` picks the implementation."""
