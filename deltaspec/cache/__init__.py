"""Caches: paged attention KV, GDN state slots with their replay-log cursors, prefix checkpoints, the manager
that hands them to sequences, and the memory plan."""
