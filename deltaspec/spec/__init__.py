"""Speculative decoding: the Speculator, the Drafter protocol and the drafters (n-gram, MTP, draft model),
verification, and the draft-length policy."""
