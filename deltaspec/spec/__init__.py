"""Speculative decoding: the Drafter protocol and the drafters (n-gram, MTP, draft model, block)."""
