"""Caches: paged attention KV, GDN state slots, and the manager that hands them to sequences."""
